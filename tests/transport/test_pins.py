"""A restarting rl-infer pins the version it loads: rl-sync's retention spares it."""

import subprocess
import sys

from procs import write_recipe
from rlcli.config import load_recipe
from rlcli.sync.syncer import Syncer
from rlcli.transport.atomic import atomic_dir, is_stable
from rlcli.transport.pins import pin, pin_latest, unpin
from rlcli.transport.rundir import RunDir


def test_retention_spares_a_pinned_version_until_it_is_unpinned(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, sync={"keep_weights": 2}))
    run = RunDir(run_dir)
    for step in range(6):
        with atomic_dir(run.weights_dir(step), {"step": step}):
            pass
    with atomic_dir(run.checkpoint_dir(4), {"step": 4}):  # else policy 0 is kept for a trainer restart
        pass
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    mine = pin(run.root, "infer-0", 1)  # a server loading v1 before it registers
    stale = pin(run.root, "infer-1", 2)
    stale.write_text(stale.read_text().replace(f'"pid": {__import__("os").getpid()}', f'"pid": {dead}'))
    syncer = Syncer(cfg, run)
    try:
        syncer.policy_version = 5
        syncer.retain()
        assert run.stable_steps("weights") == [1, 4, 5]  # v2's pin belongs to a dead process
        unpin(mine)
        syncer.retain()
        assert run.stable_steps("weights") == [4, 5]
    finally:
        syncer.close()


def test_a_reader_never_keeps_a_pin_on_a_version_that_is_gone(tmp_path):
    run = RunDir(tmp_path)
    versions = iter([3, 4])

    def latest():  # v3 is pruned between the reader choosing it and pinning it
        v = next(versions)
        if v == 4:
            with atomic_dir(run.weights_dir(4), {"step": 4}):
                pass
        return v

    version, path = pin_latest(run.root, "infer-0", latest)
    assert version == 4 and is_stable(run.weights_dir(4)) and '"version": 4' in path.read_text()


def test_rl_sync_puts_back_a_version_a_killed_rl_sync_had_moved_aside(tmp_path, tiny_model_dir):
    from rlcli.transport.atomic import _HOST

    run_dir = tmp_path / "run"
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir))
    run = RunDir(run_dir)
    with atomic_dir(run.weights_dir(3), {"step": 3}):
        pass
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    run.weights_dir(3).rename(run.weights_dir(3).with_name(f".step_3.old-{_HOST}-r0-{dead}-0123abcd"))
    assert run.stable_steps("weights") == []
    syncer = Syncer(cfg, run)
    try:
        assert run.stable_steps("weights") == [3]
    finally:
        syncer.close()


def test_milestone_versions_are_never_pruned(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir,
                                   sync={"keep_weights": 2, "keep_weights_every": 3}))
    run = RunDir(run_dir)
    for step in range(9):
        with atomic_dir(run.weights_dir(step), {"step": step}):
            pass
    with atomic_dir(run.checkpoint_dir(8), {"step": 8}):
        pass
    syncer = Syncer(cfg, run)
    try:
        syncer.policy_version = 8
        syncer.retain()
        assert run.stable_steps("weights") == [3, 6, 7, 8]
    finally:
        syncer.close()
