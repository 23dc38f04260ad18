"""Checkpoints written behind the step (rlcli.train.async_checkpoint): the same files as a
synchronous save of the state at the step, even when the model changes while they are written;
a kill mid-write resumes the checkpoint before; shutdown commits the pending one."""

import pickle
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from procs import wait_until
from rlcli.config import load_recipe
from rlcli.train import async_checkpoint
from rlcli.train.checkpoint import save_checkpoint
from rlcli.train.trainer import Trainer
from rlcli.transport.atomic import is_stable, read_marker
from rlcli.transport.rundir import RunDir
from test_resume import setup  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(300)


def gate_writes(monkeypatch) -> threading.Event:
    """Hold every background write until the returned event is set."""
    go, write = threading.Event(), async_checkpoint.write_checkpoint

    def gated(*args, **kwargs):
        go.wait(60)
        return write(*args, **kwargs)

    monkeypatch.setattr(async_checkpoint, "write_checkpoint", gated)
    return go


def move_state(trainer: Trainer) -> None:
    """One optimizer step on a made-up gradient: moments and step counts become non-zero."""
    for p in trainer.model.parameters():
        p.grad = torch.full_like(p, 0.01)
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.name != "STABLE"}


def test_the_background_checkpoint_equals_a_synchronous_one_bit_for_bit(setup, monkeypatch):
    cfg, run = setup
    trainer = Trainer(cfg, run)
    try:
        assert trainer.checkpointer is not None  # the default: train.checkpoint.background
        move_state(trainer)
        save_checkpoint(run, 1, trainer.model, trainer.optimizer, trainer.scheduler, {"step": 5}, 3)
        go = gate_writes(monkeypatch)
        trainer.checkpointer.save(2, trainer.model, trainer.optimizer, trainer.scheduler, {"step": 5})
        assert not is_stable(run.checkpoint_dir(2))
        move_state(trainer)  # the next step changes the model and optimizer while step 2 is written
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(1.0)
        go.set()
        trainer.checkpointer.wait()
    finally:
        trainer.close()
    sync, background = files(run.checkpoint_dir(1)), files(run.checkpoint_dir(2))
    assert sorted(sync) == sorted(background) and ".metadata" in sync and len(sync) >= 2
    for name in sync:
        if name == ".metadata":  # DCP's index: equal but for the id every save draws (two sync saves differ too)
            a, b = (pickle.loads(d[name]) for d in (sync, background))
            # and, on a GPU, for whether the saved tensors were in pinned memory (the background copies are)
            for meta in (a, b):
                for entry in meta.state_dict_metadata.values():
                    if hasattr(entry, "properties"):
                        entry.properties.pin_memory = False
            assert (a.state_dict_metadata, a.storage_data) == (b.state_dict_metadata, b.storage_data)
        else:
            assert sync[name] == background[name], f"{name} of the background checkpoint differs"
    assert read_marker(run.checkpoint_dir(2))["manifest"]["sizes"] == \
        read_marker(run.checkpoint_dir(1))["manifest"]["sizes"]


def test_close_commits_the_pending_checkpoint(setup, monkeypatch):
    cfg, run = setup
    trainer = Trainer(cfg, run)
    go = gate_writes(monkeypatch)
    try:
        trainer.checkpoint(1)
        assert not is_stable(run.checkpoint_dir(1)) and trainer.checkpointer.pending_step == 1
        threading.Timer(0.3, go.set).start()
    finally:
        trainer.close()
    assert is_stable(run.checkpoint_dir(1)), "close() returned before the pending checkpoint was committed"
    again = Trainer(cfg, run)
    try:
        assert again.step == 1
    finally:
        again.close()


def test_a_failed_background_write_raises_at_the_next_save(setup, monkeypatch):
    cfg, run = setup
    trainer = Trainer(cfg, run)

    def broken(*args, **kwargs):
        raise OSError("disk went away")

    monkeypatch.setattr(async_checkpoint, "write_checkpoint", broken)
    try:
        trainer.checkpoint(1)
        with pytest.raises(RuntimeError, match="writing a checkpoint failed: disk went away"):
            trainer.checkpoint(2)
    finally:
        trainer.close()


CHILD = """
import sys, time
from pathlib import Path
from rlcli.config import load_recipe
from rlcli.train import checkpoint
from rlcli.train.trainer import Trainer
from rlcli.transport.rundir import RunDir

cfg = load_recipe(sys.argv[1])
trainer = Trainer(cfg, RunDir(cfg.run_dir))
trainer.checkpoint(1)
trainer.checkpointer.wait()
save = checkpoint.dcp.save

def save_then_hang(*args, **kwargs):  # every shard written, the commit not yet done
    save(*args, **kwargs)
    Path(sys.argv[2]).write_text("written")
    time.sleep(600)

checkpoint.dcp.save = save_then_hang
for p in trainer.model.parameters():
    p.data.add_(1.0)
trainer.checkpoint(2)
time.sleep(600)
"""


def test_a_kill_during_a_background_write_resumes_the_checkpoint_before(setup, tmp_path):
    cfg, run = setup
    first = Trainer(cfg, run)  # the SFT warm-up and policy 0, before the child starts
    policy_zero = [p.detach().clone() for p in first.model.parameters()]  # what the child's checkpoint 1 holds
    first.close()
    recipe = tmp_path / "r.toml"
    flag = tmp_path / "written"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), str(recipe), str(flag)])
    try:
        wait_until(lambda: flag.exists() or child.poll() is not None, 240, "the child's second checkpoint written")
        assert child.poll() is None, "the child exited early"
        assert any(".tmp-" in p.name for p in (run.root / "checkpoints").iterdir())
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert run.stable_steps("checkpoints") == [1]
    again = Trainer(load_recipe(recipe), RunDir(cfg.run_dir))
    try:
        assert again.step == 1
        assert all(torch.equal(a, b) for a, b in zip(policy_zero, again.model.parameters()))
    finally:
        again.close()
    assert not [p for p in (run.root / "checkpoints").iterdir() if ".tmp-" in p.name]


TERM_CHILD = """
import sys, time
from pathlib import Path
from rlcli.config import load_recipe
from rlcli.train import checkpoint, trainer
from rlcli.transport.rundir import RunDir

save = checkpoint.dcp.save

def slow_save(*args, **kwargs):  # the background write of step 1 is still going when SIGTERM comes
    Path(sys.argv[2]).write_text("writing")
    time.sleep(3)
    save(*args, **kwargs)

checkpoint.dcp.save = slow_save
cfg = load_recipe(sys.argv[1])
sys.exit(trainer.run(cfg, RunDir(cfg.run_dir)))
"""


def test_sigterm_exits_after_the_pending_checkpoint_is_committed(setup, tmp_path):
    """rl-train's own exit path (rlcli.train.trainer.run): SIGTERM while step 1's checkpoint is
    written behind the trainer (which waits for batch 2) ends the process cleanly, and only
    after that checkpoint is committed."""
    from test_resume import groups

    from rlcli.orchestrate.rollouts import write_batch

    cfg, run = setup
    write_batch(run, 1, groups(4), 1, 256, 1.0)
    flag = tmp_path / "writing"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(TERM_CHILD), str(tmp_path / "r.toml"), str(flag)])
    try:
        wait_until(lambda: flag.exists() or child.poll() is not None, 240, "step 1's checkpoint being written")
        assert child.poll() is None, "the child exited early"
        assert not is_stable(run.checkpoint_dir(1))
        child.send_signal(signal.SIGTERM)
        assert child.wait(60) == 0
    finally:
        child.kill()
        child.wait()
    assert run.stable_steps("checkpoints") == [1], "SIGTERM's exit did not wait for the pending checkpoint"
