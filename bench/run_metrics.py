"""What the loop benches share: run a recipe through `rl-orchestrate up`, and read what its
processes wrote in the run directory (RUN/metrics/<command>.jsonl, timings from RUN/logs).

Imported by the scripts beside it (``python bench/x.py`` puts bench/ on sys.path).
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_up(recipe: Path, run_dir: Path, args: list[str] = (), timeout_s: float | None = None) -> str:
    """`rl-orchestrate up RECIPE --run-dir RUN_DIR --no-plot ARGS`; returns what went wrong ("" when it
    exited 0). Past ``timeout_s`` it gets SIGTERM (it stops its children by pid), then SIGKILL after
    30 s; the steps finished by then stay in RUN_DIR/metrics."""
    cmd = [sys.executable, "-m", "rlcli.cli.orchestrate", "up", str(recipe), "--run-dir", str(run_dir), "--no-plot",
           *args]
    env = {"NCCL_NVLS_ENABLE": "0",  # NVLink multicast stays off on the GPU machines
           **os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
        return f"timed out after {timeout_s:.0f} s (stopped; the finished steps are kept)"
    return "" if proc.returncode == 0 else f"exited {proc.returncode}:\n{err[-3000:]}"


def jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file, one per line ([] when the file does not exist)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def read_metrics(run_dir: Path, name: str) -> list[dict]:
    """RUN/metrics/<name>.jsonl: one object per step of that command (train, orchestrate, sft)."""
    return jsonl(Path(run_dir) / "metrics" / f"{name}.jsonl")


def log_seconds(run_dir: Path, pattern: str, regex: str) -> list[float]:
    """The first group of ``regex`` as seconds, over every match in RUN/logs/<pattern> (files in name order)."""
    out = []
    for log in sorted((Path(run_dir) / "logs").glob(pattern)):
        out += [float(m.group(1)) for m in re.finditer(regex, log.read_text(errors="replace"))]
    return out


def infer_load_times(run_dir: Path) -> list[float]:
    """rl-infer's in-flight weight loads (``loaded policy vN in Xs`` in its logs), in seconds."""
    return log_seconds(run_dir, "infer-*.log", r"loaded policy v\d+ in ([0-9.]+)s")


def sync_live_times(run_dir: Path) -> list[float]:
    """Per policy, in order: seconds from rl-sync first seeing it published to it being live on every
    server, from ``policy vN live on K server(s), Xs after rl-sync first saw it`` in rl-sync's log
    (policy 0's includes the servers' start-up)."""
    return log_seconds(run_dir, "sync-*.log", r"policy v\d+ live on \d+ server\(s\), ([0-9.]+)s after")
