"""rl-train restarts: no second SFT warm-up once rl-sync pruned weights/step_0, a corrupt
batch is deleted and waited for instead of crash-looping the trainer, and one flipped byte
in a checkpoint, its marker or policy 0 is caught and falls back."""

import threading

import pytest
import torch

from integrity import flip_byte, flip_marker_step
from procs import wait_until, write_recipe
from rlcli.config import load_recipe
from rlcli.envs import Task
from rlcli.orchestrate.rollouts import Group, write_batch
from rlcli.protocol import Completion
from rlcli.train.checkpoint import save_checkpoint
from rlcli.train.trainer import Trainer
from rlcli.transport import atomic
from rlcli.transport.atomic import is_stable, remove_dir, verify_files
from rlcli.transport.rundir import RunDir

pytestmark = pytest.mark.timeout(300)


def groups(n: int) -> list[Group]:
    out = []
    for i in range(n):
        g = Group(Task(f"t{i}"), [5, 6, 7], 0)
        g.completions = [Completion(token_ids=[8, 9], logprobs=[-1.0, -1.0], versions=[0, 0], finish_reason="length")
                         for _ in range(2)]
        g.rewards, g.advantages = [0.0, 1.0], [-0.5, 0.5]
        out.append(g)
    return out


@pytest.fixture
def setup(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir,
                          train={"sft": {"num_steps": 2, "batch_size": 4}})
    cfg = load_recipe(recipe)
    run = RunDir(run_dir)
    run.claim("e2e", {})
    return cfg, run


def test_restart_after_policy_zero_was_pruned_does_not_rerun_the_warm_up(setup):
    cfg, run = setup
    trainer = Trainer(cfg, run)
    try:
        assert len(run.read_metrics("sft")) == 1 and is_stable(run.weights_dir(0))
        trainer.publish(1)
        save_checkpoint(run, 1, trainer.model, trainer.optimizer, trainer.scheduler, {"step": 1}, 2)
        saved = [p.detach().clone() for p in trainer.model.parameters()]
    finally:
        trainer.close()
    remove_dir(run.weights_dir(0))  # what rl-sync's retention does after keep_weights versions
    again = Trainer(cfg, run)
    try:
        assert len(run.read_metrics("sft")) == 1, "the SFT warm-up ran a second time"
        assert not is_stable(run.weights_dir(0))
        assert again.step == 1
        assert all(torch.equal(a, b) for a, b in zip(saved, again.model.parameters()))
    finally:
        again.close()


@pytest.mark.parametrize("background", [True, False])
def test_milestone_checkpoints_stay_beside_the_newest(setup, background):
    cfg, run = setup
    c = cfg.train.checkpoint
    c.keep, c.keep_every, c.background = 1, 2, background
    trainer = Trainer(cfg, run)
    try:
        for step in range(1, 6):
            trainer.checkpoint(step)
    finally:
        trainer.close()  # flushes a background write
    assert run.stable_steps("checkpoints") == [2, 4, 5]


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(setup):
    cfg, run = setup
    trainer = Trainer(cfg, run)
    try:
        for step in (1, 2):
            save_checkpoint(run, step, trainer.model, trainer.optimizer, trainer.scheduler, {"step": step}, 2)
    finally:
        trainer.close()
    metadata = run.checkpoint_dir(2) / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:-1] + b"\0")  # same size, other bytes
    again = Trainer(cfg, run)
    try:
        assert again.step == 1
    finally:
        again.close()


@pytest.mark.parametrize("damage", ["shard", "marker"])
def test_a_flipped_byte_in_the_newest_checkpoint_falls_back_to_the_one_before(setup, damage, monkeypatch):
    """A weight value in DCP's shard file (same size; counted as large, so only the reader's hash
    of the bytes DCP parses sees it), or the STABLE marker's step."""
    monkeypatch.setattr(atomic, "SMALL_FILE_BYTES", 0)
    cfg, run = setup
    trainer = Trainer(cfg, run)
    try:
        save_checkpoint(run, 1, trainer.model, trainer.optimizer, trainer.scheduler, {"step": 1}, 2)
        first = [p.detach().clone() for p in trainer.model.parameters()]
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(1.0)
        save_checkpoint(run, 2, trainer.model, trainer.optimizer, trainer.scheduler, {"step": 2}, 2)
    finally:
        trainer.close()
    if damage == "shard":
        flip_byte(run.checkpoint_dir(2) / "__0_0.distcp")
    else:
        flip_marker_step(run.checkpoint_dir(2))
    again = Trainer(cfg, run)
    try:
        assert again.step == 1, "resumed from the corrupt checkpoint"
        assert all(torch.equal(a, b) for a, b in zip(first, again.model.parameters()))
    finally:
        again.close()


def test_a_flipped_byte_in_policy_zero_writes_it_again(setup, monkeypatch):
    monkeypatch.setattr(atomic, "SMALL_FILE_BYTES", 0)
    cfg, run = setup
    Trainer(cfg, run).close()
    flip_byte(run.weights_dir(0) / "model.safetensors")
    assert verify_files(run.weights_dir(0)) == ["model.safetensors does not match its xxh3_64"]
    again = Trainer(cfg, run)
    try:
        assert len(run.read_metrics("sft")) == 2, "the corrupt policy 0 was trained from"
        assert is_stable(run.weights_dir(0)) and verify_files(run.weights_dir(0)) == []
    finally:
        again.close()


@pytest.mark.parametrize("damage", ["file", "marker", "split"])
def test_a_corrupt_batch_is_deleted_and_the_rewrite_is_trained(setup, damage, caplog):
    """A damaged batch, or one split for another number of trainer ranks than this rl-train's
    (its rank 0 would train half of it), is deleted; the trainer waits for the rewrite."""
    cfg, run = setup
    write_batch(run, 1, groups(4), 2 if damage == "split" else 1, 256, 1.0)
    if damage == "file":
        flip_byte(run.rollouts_dir(1) / "0.msgpack")
    elif damage == "marker":
        flip_marker_step(run.rollouts_dir(1))
    trainer = Trainer(cfg, run)
    got = []
    reader = threading.Thread(target=lambda: got.append(trainer.next_batch(1)))
    reader.start()
    try:
        wait_until(lambda: not run.rollouts_dir(1).exists() or not reader.is_alive(), 60, "the corrupt batch deleted")
        assert reader.is_alive(), f"the trainer did not wait for a rewrite: {got}"
        assert not run.rollouts_dir(1).exists()  # deleted: rl-orchestrate sees it missing
        write_batch(run, 1, groups(4), 1, 256, 1.0)  # rl-orchestrate's rewrite
        reader.join(timeout=60)
        assert got and got[0].step == 1 and got[0].num_samples == 8
        if damage == "split":
            assert "set orchestrate.num_train_ranks = 1 for rl-orchestrate" in caplog.text
    finally:
        trainer.stopping = True
        reader.join()
        trainer.close()


def test_an_extended_run_keeps_its_schedule_with_schedule_steps(setup):
    """A restart with a larger num_steps reshapes a decaying schedule (the learning rate at the step
    resumed jumps up) unless train.schedule_steps pins where it ends: then the restarted trainer's
    learning rate and entropy bonus are those the first run had, and past the pinned step they stay
    at the schedule's last values."""
    import msgspec

    from rlcli.errors import ConfigError
    from rlcli.train.trainer import loss_config_at, schedule_horizon

    cfg, run = setup
    train = msgspec.structs.replace(cfg.train, optim=msgspec.structs.replace(cfg.train.optim, schedule="linear",
                                                                                 min_lr_ratio=0.25))
    first = msgspec.structs.replace(cfg, num_steps=10, train=train)
    trainer = Trainer(first, run)
    try:
        for _ in range(6):
            trainer.optimizer.step()
            trainer.scheduler.step()
        save_checkpoint(run, 6, trainer.model, trainer.optimizer, trainer.scheduler, {"step": 6}, 2)
        trainer.optimizer.step()
        trainer.scheduler.step()
        lr_at_7 = trainer.optimizer.param_groups[0]["lr"]
    finally:
        trainer.close()

    def resumed_lr(cfg_) -> float:  # of the step after the one resumed from
        again = Trainer(cfg_, run)
        try:
            assert again.step == 6
            again.optimizer.step()
            again.scheduler.step()
            return again.optimizer.param_groups[0]["lr"]
        finally:
            again.close()

    assert resumed_lr(msgspec.structs.replace(first, num_steps=20)) > lr_at_7 * 1.2  # reshaped
    pinned = msgspec.structs.replace(first, num_steps=20, train=msgspec.structs.replace(train, schedule_steps=10))
    assert resumed_lr(pinned) == pytest.approx(lr_at_7)
    assert schedule_horizon(pinned) == 10 and schedule_horizon(first) == 10
    loss = msgspec.structs.replace(train.loss, entropy_coef=0.01, entropy_schedule="linear")
    assert [loss_config_at(loss, s, schedule_horizon(pinned)).entropy_coef for s in (10, 15)] == [0.0, 0.0]
    with pytest.raises(ConfigError, match="train.schedule_steps must be >= 0"):
        load_recipe(None, {"train.schedule_steps": -1})


def test_a_checkpointed_step_whose_weights_never_committed_is_published_on_resume(setup):
    """The checkpoint and the weights of a step commit on two threads: a trainer killed between them
    resumed past a policy never published, and at the last step the run ended without its final one."""
    import msgspec

    cfg, run = setup
    cfg = msgspec.structs.replace(cfg, num_steps=2)
    trainer = Trainer(cfg, run)
    try:
        trainer.publish(1)
        trainer.weights.wait()
        save_checkpoint(run, 2, trainer.model, trainer.optimizer, trainer.scheduler, {"step": 2}, 2)
        want = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    assert run.stable_steps("weights") == [0, 1]  # killed before weights/step_2 committed
    again = Trainer(cfg, run)
    try:
        assert again.step == 2
        assert again.train() == 0  # "already trained", and policy 2 published
    finally:
        again.close()
    assert run.stable_steps("weights") == [0, 1, 2] and not verify_files(run.weights_dir(2))
    from rlcli.models import load_model

    got = load_model(run.weights_dir(2), "cpu", torch.float32, 0).state_dict()
    assert all(torch.equal(got[k].float(), want[k].float()) for k in want)
    # Weights of the step (or later) on disk: nothing is published again.
    stamp = (run.weights_dir(2) / "STABLE").stat().st_mtime_ns
    third = Trainer(cfg, run)
    try:
        assert third.train() == 0
    finally:
        third.close()
    assert (run.weights_dir(2) / "STABLE").stat().st_mtime_ns == stamp


def test_a_loss_of_ones_own_is_named_by_import_path_and_trained_with(setup):
    """train.loss.kind = package.module:function: rl-train imports it and trains with it; a path that
    does not import, or names something not callable, is refused before the run directory is claimed."""
    import msgspec

    import custom_loss_example
    from rlcli.cli.common import open_run
    from rlcli.errors import ConfigError

    cfg, run = setup
    loss = msgspec.structs.replace(cfg.train.loss, kind="custom_loss_example:halved_icepop")
    cfg = msgspec.structs.replace(cfg, num_steps=1, train=msgspec.structs.replace(cfg.train, loss=loss))
    write_batch(run, 1, groups(4), 1, 256, 1.0)
    custom_loss_example.CALLS.clear()
    trainer = Trainer(cfg, run)
    try:
        assert trainer.train() == 0
    finally:
        trainer.close()
    assert sum(custom_loss_example.CALLS) == 8 * 2  # every loss token of the 8 samples went through it
    for kind, needle in (("no_such_module_x:f", "cannot import no_such_module_x"),
                         ("custom_loss_example:missing", "custom_loss_example has no attribute missing"),
                         ("custom_loss_example:NOT_CALLABLE", "NOT_CALLABLE is not callable")):
        bad = msgspec.structs.replace(cfg, run_dir=str(run.root.parent / "other"), train=msgspec.structs.replace(
            cfg.train, loss=msgspec.structs.replace(loss, kind=kind)))
        with pytest.raises(ConfigError, match=f"train.loss.kind '{kind}': {needle}"):
            open_run(bad, "train")
        assert not (run.root.parent / "other").exists()
