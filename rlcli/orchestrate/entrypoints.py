"""`rl-orchestrate run` and `rl-orchestrate status`."""

import time
from pathlib import Path

from rlcli.config import RecipeConfig
from rlcli.errors import RunDirError
from rlcli.logging import console
from rlcli.orchestrate.dashboard import LiveView
from rlcli.orchestrate.loop import Orchestrator
from rlcli.process import stop_on_signals
from rlcli.transport.registry import list_entries
from rlcli.transport.rundir import RunDir


def orchestrate(cfg: RecipeConfig, run: RunDir) -> int:
    orch = Orchestrator(cfg, run)
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


def status(run_dir: Path) -> dict:
    run = RunDir(run_dir)
    if not (run.root / "run.json").is_file():
        raise RunDirError(f"{run.root} is not a run directory (no run.json)")
    return {
        "run_dir": str(run.root),
        "progress": {c: run.read_progress(c) for c in ("train", "orchestrate", "sync")},
        "weights": run.stable_steps("weights"),
        "rollouts": run.stable_steps("rollouts"),
        "checkpoints": run.stable_steps("checkpoints"),
        "processes": [{"key": e.key, "pid": e.pid, "host": e.host, "endpoints": e.endpoints, **e.info}
                      for e in list_entries(run.registry_dir())],
    }
