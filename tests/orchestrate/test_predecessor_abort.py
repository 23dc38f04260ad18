"""A SIGKILLed rl-orchestrate's requests do not keep decoding on a real rl-infer: its
restarted successor aborts them on first contact and its own work goes through.

The first orchestrator asks for completions of 60,000 tokens (EOS ignored), minutes of
decoding on the tiny model; the successor runs with ``sampling.max_tokens 8``
(``sampling`` is not part of the run's identity), so the server can only be idle again
soon after the restart if the dead one's sequences were aborted.
"""

import signal

import pytest

from procs import Procs, wait_until, write_recipe
from rlcli.protocol import HealthRequest, HealthResponse
from rlcli.protocol.batch import decode_batch
from rlcli.transport.atomic import is_stable
from rlcli.transport.registry import list_entries
from rlcli.transport.zmq import RpcClient
from tiny import write_tiny_model

pytestmark = pytest.mark.timeout(240)

ENDLESS_ENV = '''
from rlcli.envs import Task


class Endless:
    """Every completion runs to sampling.max_tokens (EOS ignored)."""

    def sample_task(self, rng):
        return Task(prompt="ab" * rng.randint(1, 3), ignore_eos=True)

    def reward(self, task, completion):
        return completion.count("a") / max(len(completion), 1)


def make(**args):
    return Endless()
'''


def health(endpoint: str) -> HealthResponse:
    client = RpcClient(endpoint)
    try:
        reply = client.call(HealthRequest(request_id="h"), timeout_s=30)
        assert isinstance(reply, HealthResponse), reply
        return reply
    finally:
        client.close()


def test_a_killed_orchestrators_requests_are_aborted_by_its_successor(tmp_path, monkeypatch):
    from procs import serve_initial_policy

    user = tmp_path / "user"
    user.mkdir()
    (user / "endless_env.py").write_text(ENDLESS_ENV)
    monkeypatch.setenv("PYTHONPATH", f"{user}:{__import__('os').environ.get('PYTHONPATH', '')}")
    model_dir = write_tiny_model(tmp_path / "tiny", max_position_embeddings=65536)
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", model_dir, run_dir, top={"num_steps": 1},
                          model={"max_seq_len": 61000}, train={"micro_batch_tokens": 61000},
                          env={"name": "endless_env:make"},
                          infer={"engine": {"name": "native", "num_threads": 1, "kv_cache_memory_mb": 160}},
                          orchestrate={"batch_size": 2, "group_size": 2, "max_async": 1,
                                       "sampling": {"max_tokens": 60000}})
    serve_initial_policy(run_dir, model_dir)
    procs = Procs(tmp_path / "logs")
    try:
        procs.start("infer-0", recipe, "--id", "0")
        procs.start("sync", recipe)  # announces policy 0, which the orchestrators wait for
        entries = wait_until(lambda: list_entries(run_dir / "registry", "infer"), 60, "rl-infer registered", procs)
        endpoint = entries[0].endpoints["rpc"]
        procs.start("orchestrate", recipe)
        wait_until(lambda: health(endpoint).num_running >= 2, 60, "the first orchestrator's requests running", procs)
        procs.kill("orchestrate", signal.SIGKILL)
        before = health(endpoint)
        assert before.num_running + before.num_waiting >= 2, "the dead orchestrator's requests already ended"
        aborted_before = before.stats["num_aborted"]

        procs.start("orchestrate", recipe, "--orchestrate.sampling.max_tokens", "8")
        log = tmp_path / "logs" / "infer-0.1.log"
        wait_until(lambda: "of a previous client orchestrate-0." in log.read_text(), 60,
                   "rl-infer aborting the dead orchestrator's requests", procs)
        wait_until(lambda: is_stable(run_dir / "rollouts" / "step_1"), 120, "the successor's batch 1", procs)
        after = wait_until(lambda: (h := health(endpoint)).num_running + h.num_waiting == 0 and h, 60,
                           "rl-infer idle: no 60,000-token request still decoding", procs)
        assert after.stats["num_aborted"] > aborted_before
        batch = decode_batch((run_dir / "rollouts" / "step_1" / "0.msgpack").read_bytes())
        completion_tokens = sum(int(mb.loss_mask.numpy().sum()) for mb in batch.micro_batches)
        assert 0 < completion_tokens <= batch.num_samples * 8  # written from the successor's 8-token requests
    finally:
        procs.stop_all()
