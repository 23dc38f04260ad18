"""`rl-orchestrate run` and `rl-orchestrate status`."""

import time
from pathlib import Path

from rlcli.config import RecipeConfig
from rlcli.errors import RunDirError
from rlcli.logging import console
from rlcli.orchestrate.dashboard import LiveView
from rlcli.orchestrate.loop import Orchestrator
from rlcli.process import stop_on_signals
from rlcli.transport import registry
from rlcli.transport.registry import Entry, list_entries
from rlcli.transport.rundir import RunDir


def prepare(cfg: RecipeConfig) -> tuple:
    """The environment and tokenizer ``cfg`` names, built before the run directory is claimed: what
    refuses them (env.args, the environment's import, the tokenizer) refuses the start, no claim made."""
    from rlcli.envs import make_env
    from rlcli.models.tokenizer import load_tokenizer

    from rlcli.orchestrate.loop import check_env_settings

    env = make_env(cfg.env)
    check_env_settings(cfg, env)
    return env, load_tokenizer(cfg.model.path)


def orchestrate(cfg: RecipeConfig, run: RunDir, env=None, tokenizer=None) -> int:
    orch = Orchestrator(cfg, run, env, tokenizer)
    stop_on_signals(lambda: setattr(orch, "stopping", True))
    try:
        if console.is_terminal:
            with LiveView(run) as view:
                last = 0.0

                def tick():
                    nonlocal last
                    if time.monotonic() - last > 0.5:
                        view.update()
                        last = time.monotonic()

                orch.on_tick = tick
                return orch.loop()
        return orch.loop()
    finally:
        orch.close()


def liveness(entry: Entry) -> str:
    """alive (beat within STALE_AFTER_S), busy (inside an announced long operation), or dead or stopped."""
    if time.time() - entry.heartbeat < registry.STALE_AFTER_S:
        return "alive"
    return "busy" if entry.alive() else "dead or stopped"


def process_row(entry: Entry, progress: dict, newest_weights: int | None, run: RunDir | None = None) -> dict:
    """One process of the registry with its liveness, version and lag.

    version: rl-infer the policy it serves, rl-sync the policy live everywhere, rl-train the
    last step it trained, rl-orchestrate the last batch it wrote. lag: rl-infer/rl-sync
    policies behind the newest published one, rl-train batches written but not trained yet,
    rl-orchestrate steps ahead of the trainer. work (rl-infer, given ``run``): see :func:`serving`."""
    trained = int(progress["train"].get("step", 0))
    written = int(progress["orchestrate"].get("step", 0))
    work = None
    if entry.role == "infer" and run is not None:
        live = progress["sync"].get("version")
        work = serving(entry, None if live is None else int(live), run)
    if entry.role in ("infer", "sync"):
        version = entry.info.get("version", progress["sync"].get("version") if entry.role == "sync" else None)
        lag = None if version is None or newest_weights is None else newest_weights - int(version)
    elif entry.role == "train":
        version, lag = entry.info.get("step", trained), written - int(entry.info.get("step", trained))
    elif entry.role == "orchestrate":
        version, lag = written, written - trained
    else:
        version = lag = None
    return {"key": entry.key, "pid": entry.pid, "host": entry.host, "state": liveness(entry),
            "heartbeat_age_s": round(entry.silent_s(), 1), "version": version, "lag": lag,
            "endpoints": entry.endpoints, "info": entry.info, "work": work}


def serving(entry: Entry, live: int | None, run: RunDir) -> str | None:
    """An rl-infer's work, for the status table: behind (serving a policy older than the live one, so
    rl-orchestrate sends it nothing) or its tokens per second in its newest metrics record, if that
    ended within the last minute."""
    version = entry.info.get("version")
    if live is not None and version is not None and int(version) < live:
        return f"behind v{live}"
    record = last_record(run.metrics_file(entry.key))
    if record is None or time.time() - record.get("time", 0) > 60:
        return None
    return f"{record['gen_tokens_per_s']:.0f} tok/s"


def last_record(path: Path) -> dict | None:
    """The last complete line of a metrics file, read from its end."""
    import json

    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def status(run_dir: Path) -> dict:
    run = RunDir(run_dir)
    if not (run.root / "run.json").is_file():
        raise RunDirError(f"{run.root} is not a run directory (no run.json)")
    progress = {c: run.read_progress(c) for c in ("train", "orchestrate", "sync")}
    weights = run.stable_steps("weights")
    return {
        "run_dir": str(run.root),
        "progress": progress,
        "weights": weights,
        "rollouts": run.stable_steps("rollouts"),
        "checkpoints": run.stable_steps("checkpoints"),
        "eval": last_record(run.metrics_file("eval")),  # the newest evaluation (orchestrate.eval), if any
        "processes": [process_row(e, progress, weights[-1] if weights else None, run)
                      for e in list_entries(run.registry_dir(), alive_only=False)],
    }


def watch_status(run_dir: Path, interval_s: float) -> None:
    """``rl-orchestrate status RUN --watch``: the live view of the run's steps and processes,
    redrawn every ``interval_s`` until Ctrl-C (see :mod:`rlcli.orchestrate.dashboard`)."""
    status(run_dir)  # a bad run directory fails here, before the view starts
    # Ctrl-C / SIGTERM set a flag the loop checks: an exception raised at an arbitrary point
    # could leave the live view's refresh thread holding the console and hang the exit.
    stopping = []
    stop_on_signals(lambda: stopping.append(True))
    with LiveView(RunDir(run_dir)) as view:
        while not stopping:
            view.update(status=status(run_dir))
            deadline = time.monotonic() + interval_s
            while not stopping and time.monotonic() < deadline:
                time.sleep(min(0.05, interval_s))


def render_status(s: dict) -> str:
    """The status as a plain table: one line per process, then the run's durable state."""
    lines = [f"{'process':<14} {'state':<16} {'version':>7} {'lag':>4} {'silent':>7}  {'work':<12}  pid@host"]
    for p in s["processes"]:
        lines.append(f"{p['key']:<14} {p['state']:<16} {_dash(p['version']):>7} {_dash(p['lag']):>4} "
                     f"{p['heartbeat_age_s']:>6.1f}s  {_dash(p.get('work')):<12}  {p['pid']}@{p['host']}")
    last = lambda xs: xs[-1] if xs else "-"  # noqa: E731
    progress = s["progress"]
    lines.append(f"trained {progress['train'].get('step', 0)}, written {progress['orchestrate'].get('step', 0)}"
                 f", policy live v{s['progress']['sync'].get('version', '-')}; newest weights {last(s['weights'])}, "
                 f"rollouts {last(s['rollouts'])}, checkpoint {last(s['checkpoints'])}")
    e = s.get("eval")
    if e:
        k = e.get("samples_per_task")
        lines.append(f"eval of v{e.get('step')}: pass@1 {_fmt(e.get('pass@1'))}, pass@{k} {_fmt(e.get(f'pass@{k}'))}, "
                     f"reward {_fmt(e.get('reward_mean'))} over {e.get('num_tasks')} tasks")
    return "\n".join(lines)


def _dash(value) -> str:
    return "-" if value is None else str(value)


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"
