"""A full disk stops rl-train with one line and leaves the last STABLE state intact; the
next start cleans the abandoned temporaries and goes on. The full disk is a file-size
limit (RLIMIT_FSIZE, no privileges needed): writes fail with EFBIG as they would with ENOSPC."""

import resource
import signal
import subprocess
import sys

import pytest

from procs import read_jsonl, write_recipe
from rlcli.config import load_recipe
from rlcli.train.trainer import Trainer
from rlcli.orchestrate.rollouts import write_batch
from rlcli.transport.rundir import RunDir
from test_resume import groups

pytestmark = pytest.mark.timeout(300)


def train(recipe, steps: int, max_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.run([sys.executable, "-m", "rlcli.cli.train", "--config", str(recipe), "--steps", str(steps)],
                          capture_output=True, text=True, timeout=240, preexec_fn=limit if max_file_bytes else None)


def train_in_process(recipe, steps: int) -> None:
    trainer = Trainer(load_recipe(recipe, {"num_steps": steps}), RunDir(load_recipe(recipe).run_dir))
    try:
        assert trainer.train() == 0
    finally:
        trainer.close()


def temporaries(run_dir) -> list[str]:
    return [p.name for sub in ("weights", "checkpoints", "rollouts") for p in (run_dir / sub).iterdir()
            if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("transport", ["filesystem", "async_filesystem"])
def test_a_full_disk_stops_the_trainer_cleanly(tmp_path, tiny_model_dir, transport):
    """With the weights written in the step, their write is the one that fails; written behind the
    step (the default), the step's checkpoint may hit the limit first: either is named."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, sync={"backend": {"kind": transport}})
    run = RunDir(run_dir)
    for step in (1, 2):
        write_batch(run, step, groups(4), 1, 256, 1.0)
    train_in_process(recipe, 1)
    assert run.stable_steps("weights") == [0, 1] and run.stable_steps("checkpoints") == [1]

    out = train(recipe, 2, max_file_bytes=64 << 10)  # smaller than one weights file
    lines = out.stderr.strip().splitlines()
    failed = ("weights/step_2",) if transport == "filesystem" else ("weights/step_2", "checkpoints/step_2")
    assert out.returncode == 1 and lines[-1].startswith("rl-train: error: cannot write ") and \
        any(f"{what}: File too large; free space" in lines[-1] for what in failed), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert run.stable_steps("weights") == [0, 1] and run.stable_steps("checkpoints") == [1]
    # Written in the step, the failed write stops step 2 before it is recorded; written behind it,
    # step 2 was trained and recorded before its writes failed, and the restart trains it again.
    trained = [1] if transport == "filesystem" else [1, 2]
    assert run.read_progress("train")["step"] == trained[-1]

    train_in_process(recipe, 2)
    assert [m["step"] for m in read_jsonl(run_dir / "metrics" / "train.jsonl")] == trained + [2]
    assert run.stable_steps("weights") == [0, 1, 2] and run.stable_steps("checkpoints") == [1, 2]
    assert temporaries(run_dir) == []


def test_a_full_disk_behind_a_checkpoint_writer_error_is_named(tmp_path, monkeypatch):
    """DCP wraps each rank's error in a CheckpointException, and torch's zip writer reports a
    short write only as "unexpected pos": both are a full disk when the cause says so or the
    filesystem of what was being written has (almost) no space left; else the error stands."""
    import errno
    import os
    from types import SimpleNamespace

    from torch.distributed.checkpoint.api import CheckpointException

    from rlcli.transport.atomic import storage_full

    enospc = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("save", {0: (enospc, None)})
    assert "No space left on device; free space" in str(storage_full(wrapped, tmp_path / "ckpt"))
    short = CheckpointException("save", {0: (RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                          "unexpected pos 704 vs 598"), None)})
    assert storage_full(short, tmp_path / "ckpt", written=tmp_path) is None  # this disk has room
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_bavail=3, f_frsize=4096) if str(p) == str(tmp_path)
                        else real(p))
    full = storage_full(short, tmp_path / "ckpt", written=tmp_path)
    assert full is not None and str(full).startswith(f"cannot write {tmp_path / 'ckpt'}: No space left on device (0 MiB")
    assert storage_full(short, tmp_path / "ckpt") is None  # nothing written to look at
