"""Run plots with matplotlib (the optional ``plot`` extra): reward, evaluation pass@1, mismatch KL,
throughput, off-policy lag.

``rl-orchestrate up`` draws RUN/reward.png at the end of a run and ``rl-orchestrate plot RUN`` draws it
on demand, from the metrics files alone, so it works on a finished, running or copied run directory.
A panel whose metric no process has written yet is left out. The PNG is rendered in memory and written
atomically: a reader never sees half a file.
"""

import io
from pathlib import Path

from rlcli.errors import RLCLIError
from rlcli.transport.atomic import atomic_write_bytes
from rlcli.transport.rundir import RunDir

INSTALL_HINT = "plots need matplotlib: pip install 'rlcli[plot]'"

PANELS = (
    # (title, metrics file, key, y label)
    ("mean reward", "orchestrate", "reward_mean", "reward"),
    ("evaluation pass@1 (orchestrate.eval; step: the policy evaluated)", "eval", "pass@1", "pass@1"),
    ("mismatch KL (trainer vs inference)", "train", "mismatch_kl", "KL"),
    ("generation throughput", "orchestrate", "tokens_per_s", "tokens/s"),
    ("off-policy lag", "train", "off_policy_lag", "policy versions"),
)


class PlotUnavailable(RLCLIError):
    """matplotlib is not installed."""


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(run: RunDir, out: Path | None = None, title: str = "") -> Path:
    """Draw every panel that has data into ``out`` (default RUN/reward.png); returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        raise PlotUnavailable(INSTALL_HINT) from None
    metrics = {name: run.read_metrics(name) for name in {p[1] for p in PANELS}}
    panels = []
    for name, source, key, ylabel in PANELS:
        rows = [m for m in metrics[source] if isinstance(m.get(key), (int, float))]
        if rows:
            panels.append((name, [m["step"] for m in rows], [float(m[key]) for m in rows], ylabel))
    if not panels:
        raise RLCLIError(f"{run.root} has no metrics to plot yet")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, steps, values, ylabel) in zip(axes[:, 0], panels):
        ax.plot(steps, values, lw=1, alpha=0.5 if len(values) >= 10 else 1.0, label=ylabel)
        if len(values) >= 10:
            ax.plot(steps, moving_average(values, 10), lw=2, label="10-step mean")
            ax.legend(loc="best", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("RL step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    out = Path(out) if out is not None else run.root / "reward.png"
    atomic_write_bytes(out, buf.getvalue())
    return out
