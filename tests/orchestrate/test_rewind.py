"""rl-orchestrate rewind: a stopped run taken back to a checkpoint goes on from there as if the later
steps had never run; a live run, a missing or damaged checkpoint are refused by name."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from procs import read_jsonl, write_recipe
from rlcli.protocol.batch import decode_batch
from rlcli.transport.registry import Entry
from rlcli.transport.rundir import RunDir

pytestmark = pytest.mark.timeout(300)


def cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def versions(run_dir, step):
    batch = decode_batch((run_dir / "rollouts" / f"step_{step}" / "0.msgpack").read_bytes())
    v = np.concatenate([mb.versions.numpy() for mb in batch.micro_batches])
    return set(v[v >= 0].tolist())


def test_a_rewound_run_goes_on_from_the_checkpoint(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 8},
                          train={"checkpoint": {"keep": 1, "keep_every": 4}},
                          orchestrate={"eval": {"interval": 2, "num_tasks": 2, "samples": 2}, "log_samples": 1})
    out = cli("up", recipe, "--no-plot", "--max-async", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    run = RunDir(run_dir)
    assert run.stable_steps("checkpoints") == [4, 8]  # the milestone and the newest
    before = read_jsonl(run_dir / "metrics" / "train.jsonl")

    assert cli("rewind", run_dir, "--to", 3).stderr.strip().endswith("those on disk: [4, 8]")
    dry = json.loads(cli("rewind", run_dir, "--to", 4, "--dry-run").stdout)
    assert dry["removed"]["checkpoints"] == [8] and run.stable_steps("checkpoints") == [4, 8]
    done = json.loads(cli("rewind", run_dir, "--to", 4).stdout)
    assert done["removed"] == {**dry["removed"]} and done["removed"]["rollouts"] == [5, 6, 7, 8]
    assert done["metrics_records_removed"] == {"train": 4, "orchestrate": 4, "eval": 2}
    assert run.stable_steps("checkpoints") == [4] and max(run.stable_steps("weights")) == 4
    assert not (run_dir / "samples" / "step_5.jsonl").exists() and not (run_dir / "evals" / "policy_6.jsonl").exists()
    assert [m["step"] for m in read_jsonl(run_dir / "metrics" / "train.jsonl")] == [1, 2, 3, 4]
    [kept] = (run_dir / "metrics" / "rewound").glob("train-*.jsonl")
    assert read_jsonl(kept) == before[4:]
    assert run.read_progress("train")["step"] == 4 and run.read_progress("orchestrate")["step"] == 4

    out = cli("up", recipe, "--no-plot", "--max-async", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(run_dir / "metrics" / "train.jsonl")] == list(range(1, 9))
    for step in range(5, 9):  # exactly synchronous again from policy 4 on
        assert versions(run_dir, step) == {step - 1}
    assert [m["step"] for m in read_jsonl(run_dir / "metrics" / "eval.jsonl")] == [0, 2, 4, 6, 8]
    assert run.stable_steps("checkpoints") == [4, 8]


def test_rewind_refuses_a_live_run_and_a_damaged_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run")
    run.claim("e2e", {})
    for step in (2, 4):
        from rlcli.transport.atomic import atomic_dir

        with atomic_dir(run.checkpoint_dir(step), {"step": step}) as d:
            (d / "x.distcp").write_bytes(b"shard")
    entry = Entry(role="train", id="0", endpoints={}, pid=os.getpid(), host=socket.gethostname(), incarnation="a",
                  started=time.time(), heartbeat=time.time() - 3600)  # silent, but its pid lives
    run.registry_dir().mkdir(parents=True, exist_ok=True)
    (run.registry_dir() / "train-0.json").write_bytes(__import__("msgspec").json.encode(entry))
    out = cli("rewind", run.root, "--to", 2)
    assert out.returncode == 2 and "has running processes (train-0 (pid" in out.stderr
    (run.registry_dir() / "train-0.json").unlink()
    (run.checkpoint_dir(2) / "x.distcp").write_bytes(b"shorter")
    out = cli("rewind", run.root, "--to", 2)
    assert out.returncode == 2 and "checkpoint 2 is damaged" in out.stderr and run.stable_steps("checkpoints") == [2, 4]
    out = cli("rewind", run.root, "--to", 0)
    assert out.returncode == 2 and "weights/step_0 is gone" in out.stderr
