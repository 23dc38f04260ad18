"""Run plots: panels come from the metrics files, the PNG is real, and no matplotlib means one clear line."""

import subprocess
import sys

import pytest

from rlcli.config import load_recipe
from rlcli.orchestrate.launcher import Launcher
from rlcli.orchestrate.plot import PlotUnavailable, moving_average, plot_run
from rlcli.transport.rundir import RunDir

pytest.importorskip("matplotlib")

NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None\n"


def fill(run: RunDir, steps: int, train: bool) -> None:
    for s in range(1, steps + 1):
        run.append_metrics("orchestrate", {"step": s, "reward_mean": s / steps, "tokens_per_s": 100.0 + s})
        if train:
            run.append_metrics("train", {"step": s, "mismatch_kl": 1e-4 / s, "off_policy_lag": s % 3})


def height(path) -> int:
    from matplotlib.image import imread

    return imread(path).shape[0]


def test_one_panel_per_metric_that_has_data(tmp_path):
    run = RunDir(tmp_path / "run")
    fill(run, 12, train=False)
    two = plot_run(run, tmp_path / "two.png", title="t")
    fill(run, 12, train=True)
    four = plot_run(run)
    assert four == run.root / "reward.png"
    assert two.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert (height(two), height(four)) == (2 * 260, 4 * 260)
    for v in (0, 6, 12):
        run.append_metrics("eval", {"step": v, "pass@1": v / 24, "pass@4": v / 12})
    assert height(plot_run(run)) == 5 * 260  # orchestrate.eval's pass@1


def test_a_run_without_metrics_is_refused(tmp_path):
    with pytest.raises(Exception, match="no metrics to plot"):
        plot_run(RunDir(tmp_path / "empty"))


def test_moving_average():
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    assert moving_average([5], 10) == [5]
    with pytest.raises(ValueError):
        moving_average([1], 0)


def test_plot_command(tmp_path):
    run = RunDir(tmp_path / "run")
    run.claim("r", {})
    fill(run, 3, train=True)
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "plot", str(run.root), "--out",
                          str(tmp_path / "p.png")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    bad = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "plot", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr


def test_without_matplotlib_the_command_says_how_to_get_plots(tmp_path):
    run = RunDir(tmp_path / "run")
    run.claim("r", {})
    fill(run, 3, train=False)
    code = NO_MATPLOTLIB + (f"sys.argv = ['rl-orchestrate', 'plot', {str(run.root)!r}]\n"
                            "from rlcli.cli.orchestrate import main; main()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert "pip install 'rlcli[plot]'" in lines[0]


def test_without_matplotlib_the_launcher_still_finishes(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    cfg = load_recipe(None, {"run_dir": str(tmp_path / "run"), "model.path": str(tiny_model_dir)})
    run = RunDir(cfg.run_dir)
    fill(run, 3, train=False)
    with pytest.raises(PlotUnavailable):
        plot_run(run)
    assert Launcher(cfg, run).plot() is None
