"""Helpers for tests that run the commands as real processes (tracked and ended by pid)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MODULES = {"infer": ["rlcli.cli.infer", "serve"], "train": ["rlcli.cli.train", "run"], "sync": ["rlcli.cli.sync"],
           "cache": ["rlcli.cli.cache", "serve"], "orchestrate": ["rlcli.cli.orchestrate", "run"]}


def write_recipe(path: Path, model_dir: Path, run_dir: Path, **tables: dict) -> Path:
    """A small, fast recipe on the tiny test model; ``tables`` update its tables
    (``orchestrate={"max_async": 2}``; the top level is ``top={...}``)."""
    from rlcli.config import dump_toml

    tree = {
        "name": "e2e", "seed": 0, "num_steps": 6, "run_dir": str(run_dir),
        "model": {"path": str(model_dir), "max_seq_len": 48},
        "env": {"name": "reverse", "min_len": 3, "max_len": 6},
        "infer": {"engine": {"name": "native", "num_threads": 1, "kv_cache_memory_mb": 16}},
        "train": {"micro_batch_tokens": 256, "num_threads": 1, "optim": {"lr": 1e-3}},
        "orchestrate": {"batch_size": 4, "group_size": 4, "keep_rollouts": 100, "sampling": {"max_tokens": 8}},
        "sync": {"keep_weights": 100},
    }
    for table, values in tables.items():
        if table == "top":
            tree.update(values)
        elif table == "env":
            tree["env"] = values
        else:
            tree.setdefault(table, {}).update(values)
    path.write_text(dump_toml(tree))
    return path


class Procs:
    """Start commands as child processes, log each to a file, end them all by pid."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}

    def start(self, name: str, recipe: Path, *args: str) -> subprocess.Popen:
        role = name.split("-")[0]
        self.starts[name] = self.starts.get(name, 0) + 1
        log = open(self.log_dir / f"{name}.{self.starts[name]}.log", "wb")
        cmd = [sys.executable, "-m", *MODULES[role], "--config", str(recipe), *args]
        # The loop under test runs on the CPU also on a GPU host (there, 2-rank trainers would want 2 GPUs).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""})
        self.procs[name] = proc
        return proc

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def wait(self, name: str, timeout: float) -> int:
        return self.procs[name].wait(timeout=timeout)

    def logs(self) -> str:
        return "\n".join(f"==== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_until(pred, timeout: float, what: str, procs: Procs | None = None, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}\n" + (procs.logs() if procs else ""))


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def progress(run_dir: Path, command: str) -> int:
    try:
        return json.loads((run_dir / "progress" / f"{command}.json").read_text()).get("step", 0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def serve_initial_policy(run_dir: Path, model_dir: Path) -> None:
    """RUN/weights/step_0 from ``model_dir`` (random weights, seed 0), as rl-train writes it, so an
    rl-infer can start without a trainer."""
    from rlcli.models import load_model, save_model
    from rlcli.transport.atomic import atomic_dir

    with atomic_dir(run_dir / "weights" / "step_0", {"step": 0}) as tmp:
        save_model(load_model(model_dir, seed=0), tmp, source_dir=model_dir)
