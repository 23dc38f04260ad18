"""Take a stopped run back to a checkpoint (``rl-orchestrate rewind RUN --to N``): after a divergence,
to go on from a milestone (train.checkpoint.keep_every) or any checkpoint still on disk.

Every process resumes from what the run directory says, so rewinding is a change of the run
directory, made while no process runs (a live entry in RUN/registry is refused by name):

- checkpoints, weights, rollout batches, evaluations and samples past step N are deleted (each
  directory moved aside, then removed: :func:`rlcli.transport.atomic.remove_dir`);
- progress says step N for rl-train and rl-orchestrate, and the newest policy left on disk for
  rl-sync (a dataset environment's task position is taken back from batch N's metrics record where
  it carries one, ``tasks_drawn``; otherwise the epoch order goes on from where it was);
- the records of rl-train, rl-orchestrate and evaluations past step N leave their metrics files,
  which are rewritten whole, and are kept in RUN/metrics/rewound/<command>-<unix time>.jsonl.

Started again, rl-train resumes from checkpoint N (and publishes policy N if its weights are gone),
rl-orchestrate writes batches N + 1 on, rl-infer loads the newest policy left, and evaluations past
N run again. Step 0 (no checkpoint) takes the run back to policy 0, which must be on disk.
"""

import json
import socket
import time
from pathlib import Path

from rlcli.errors import ConfigError, RunDirError
from rlcli.transport.atomic import _pid_alive, atomic_write_bytes, clean_temporaries, is_stable, remove_dir, verify_dir
from rlcli.transport.registry import list_entries
from rlcli.transport.rundir import RunDir

STEPPED = ("train", "orchestrate", "eval")
"""Metrics files whose records carry the step (eval: the policy version) they belong to."""


def _steps(parent: Path, prefix: str = "step_", suffix: str = "") -> dict[int, Path]:
    """Every ``<prefix>N<suffix>`` under ``parent``, marked or not."""
    out = {}
    if parent.is_dir():
        for child in parent.iterdir():
            name = child.name
            number = name[len(prefix):len(name) - len(suffix)]
            if name.startswith(prefix) and name.endswith(suffix) and number.isdigit():
                out[int(number)] = child
    return out


def live_processes(run: RunDir) -> list[str]:
    """Registry entries of processes still running: this host's by pid, another host's by heartbeat."""
    here = socket.gethostname()
    return [f"{e.key} (pid {e.pid} on {e.host})" for e in list_entries(run.registry_dir(), alive_only=False)
            if (_pid_alive(e.pid) if e.host == here else e.alive())]


def rewind(run_dir: Path, step: int, dry_run: bool = False) -> dict:
    """Take the stopped run at ``run_dir`` back to checkpoint ``step``; what was (or would be) removed."""
    run = RunDir(run_dir)
    if not (run.root / "run.json").is_file():
        raise RunDirError(f"{run.root} is not a run directory (no run.json)")
    if step < 0:
        raise ConfigError(f"--to must be a step >= 0, got {step}")
    live = live_processes(run)
    if live:
        raise RunDirError(f"{run.root} has running processes ({', '.join(live)}); stop them before rewinding")
    checkpoints = run.stable_steps("checkpoints")
    if step == 0:
        if not is_stable(run.weights_dir(0)):
            raise RunDirError(f"{run.weights_dir(0)} is gone (pruned); rewind to a checkpoint instead: "
                              f"{checkpoints or 'none is on disk'}")
    elif step not in checkpoints:
        raise RunDirError(f"no checkpoint of step {step} in {run.root / 'checkpoints'}; those on disk: "
                          f"{checkpoints or 'none'}")
    elif problems := verify_dir(run.checkpoint_dir(step)):
        raise RunDirError(f"checkpoint {step} is damaged ({'; '.join(problems)}); rewind to another: {checkpoints}")
    doomed = {kind: sorted(s for s in _steps(run.root / kind) if s > step)
              for kind in ("checkpoints", "weights", "rollouts")}
    doomed["evals"] = sorted(s for s in _steps(run.root / "evals", "policy_", ".jsonl") if s > step)
    doomed["samples"] = sorted(s for s in _steps(run.root / "samples", suffix=".jsonl") if s > step)
    records = {c: run.read_metrics(c) for c in STEPPED}
    cut = {c: [m for m in ms if int(m.get("step", 0)) > step] for c, ms in records.items()}
    weights_left = [s for s in run.stable_steps("weights") if s <= step]
    summary = {"run_dir": str(run.root), "to": step, "dry_run": dry_run, "removed": doomed,
               "metrics_records_removed": {c: len(ms) for c, ms in cut.items()},
               "policy_left": weights_left[-1] if weights_left else None}
    if dry_run:
        return summary
    for kind in ("checkpoints", "weights", "rollouts"):
        for s in doomed[kind]:
            remove_dir(run.root / kind / f"step_{s}")
        clean_temporaries(run.root / kind)
    for s in doomed["evals"]:
        (run.root / "evals" / f"policy_{s}.jsonl").unlink(missing_ok=True)
    for s in doomed["samples"]:
        (run.root / "samples" / f"step_{s}.jsonl").unlink(missing_ok=True)
    stamp = int(time.time())
    for command, removed in cut.items():
        if not removed:
            continue
        atomic_write_bytes(run.root / "metrics" / "rewound" / f"{command}-{stamp}.jsonl", _lines(removed))
        atomic_write_bytes(run.metrics_file(command),
                           _lines([m for m in records[command] if int(m.get("step", 0)) <= step]))
    position = next((m["tasks_drawn"] for m in reversed(records["orchestrate"])
                     if m.get("step") == step and "tasks_drawn" in m), None)
    _set_progress(run, "orchestrate", step=step, **({"tasks_drawn": position} if position is not None else {}))
    _set_progress(run, "train", step=step)
    if weights_left:
        version = int(run.read_progress("sync").get("version", step))
        _set_progress(run, "sync", version=min(version, weights_left[-1]))
    else:
        run.progress_file("sync").unlink(missing_ok=True)
    return summary


def _set_progress(run: RunDir, command: str, **fields) -> None:
    """``command``'s progress record with ``fields`` changed and the rest kept (its time written anew)."""
    record = run.read_progress(command)
    record.pop("time", None)
    run.write_progress(command, **{**record, **fields})


def _lines(records: list[dict]) -> bytes:
    return "".join(json.dumps(m, sort_keys=True) + "\n" for m in records).encode()

