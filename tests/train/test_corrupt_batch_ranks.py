"""A corrupt per-rank batch file under torchrun with 2 ranks (gloo): neither rank crashes or
hangs in a collective, the batch is deleted, rl-orchestrate writes it again, and every
step is trained exactly once. Real processes: rl-infer, rl-sync, rl-orchestrate and a
2-rank rl-train."""

import pytest

from integrity import flip_byte
from procs import Procs, progress, read_jsonl, serve_initial_policy, wait_until, write_recipe
from rlcli.transport.atomic import is_stable

pytestmark = pytest.mark.timeout(300)


def test_one_ranks_corrupt_batch_is_rewritten_and_trained_once(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 3},
                          orchestrate={"num_train_ranks": 2, "max_async": 1},
                          train={"checkpoint": {"interval": 1}})
    serve_initial_policy(run_dir, tiny_model_dir)  # policy 0, so batches are written before the trainer starts
    procs = Procs(tmp_path / "logs")
    try:
        procs.start("infer-0", recipe, "--id", "0")
        procs.start("sync", recipe)
        procs.start("orchestrate", recipe)
        wait_until(lambda: is_stable(run_dir / "rollouts" / "step_1"), 120, "batch 1", procs)
        flip_byte(run_dir / "rollouts" / "step_1" / "1.msgpack")  # rank 1's file; rank 0's is intact
        procs.start("train", recipe, "--nproc-per-node", "2")
        wait_until(lambda: progress(run_dir, "train") >= 3, 180, "trainer step 3", procs)
        train = procs.procs["train"]
        assert train.poll() in (None, 0), procs.logs()
        steps = [m["step"] for m in read_jsonl(run_dir / "metrics" / "train.jsonl")]
        assert steps == [1, 2, 3], steps
        logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
        assert "rollout batch 1 is unusable" in logs["train.1.log"] and "1.msgpack is corrupt" in logs["train.1.log"]
        assert "rollout batch(es) [1] are gone but the trainer needs them; writing them again" \
            in logs["orchestrate.1.log"]
    finally:
        procs.stop_all()
