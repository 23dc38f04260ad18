"""rl-orchestrate across restarts and failures: retention never deletes a batch a restarting
trainer needs, a missing batch is written again, timed-out requests and a dead predecessor's
requests are aborted on the (real, in-process) rl-infer server."""

import threading

import pytest

from procs import serve_initial_policy, wait_until, write_recipe
from rlcli.config import load_recipe
from rlcli.envs import Task
from rlcli.infer.server import InferServer
from rlcli.orchestrate.pool import InferPool
from rlcli.orchestrate.rollouts import Group
from rlcli.protocol import BatchWritten, GenerateRequest, HealthRequest, HealthResponse, SamplingParams
from rlcli.protocol.batch import decode_batch
from rlcli.transport.atomic import atomic_dir, remove_dir
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcClient, new_request_id
from test_staleness import bare_orchestrator, finish

pytestmark = pytest.mark.timeout(120)


def mark(run: RunDir, kind: str, steps) -> None:
    for s in steps:
        with atomic_dir(run.root / kind / f"step_{s}", {"step": s}):
            pass


def test_retention_keeps_every_batch_after_the_newest_checkpoint(tmp_path):
    run = RunDir(tmp_path)
    mark(run, "rollouts", range(1, 21))
    mark(run, "checkpoints", [5])  # checkpoint.interval 20 > keep_rollouts + 1: the trainer crashed at 19
    run.write_progress("train", step=19)
    o = bare_orchestrator(1, 4, 30)
    o.run = run
    o.ocfg.keep_rollouts = 8
    o._retain()
    assert run.stable_steps("rollouts") == list(range(6, 21))  # a restart from step 5 needs 6..19


def test_a_missing_batch_is_written_again(tmp_path):
    run = RunDir(tmp_path)
    o = bare_orchestrator(1, 2, 30)
    o.run, o.next_step, o.rewrite, o.pub = run, 6, [], Announced()
    mark(run, "rollouts", [1, 2, 3, 4, 5])
    run.write_progress("train", step=3)
    remove_dir(run.rollouts_dir(4))  # the trainer found it corrupt
    o.find_missing()
    assert o.rewrite == [4] and o.num_to_dispatch() == 2 * (3 - 6 + 1 + 1 + o.ocfg.max_async)
    for v in (3, 3):
        g = Group(Task("t"), [0], v)
        finish(g, [v])
        o.buffer.append(g)
    assert o.try_rewrite()
    batch = decode_batch((run.rollouts_dir(4) / "0.msgpack").read_bytes())
    assert batch.step == 4 and batch.num_samples == 4 and o.rewrite == [] and o.next_step == 6
    assert o.pub == [BatchWritten(step=4)]  # the rewrite wakes the waiting trainer too


class Announced(list):
    """What the orchestrator's PUB socket was given to send."""

    def publish(self, msg) -> None:
        self.append(msg)


@pytest.fixture
def server(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, model={"max_seq_len": 256})
    cfg = load_recipe(recipe)
    serve_initial_policy(run_dir, tiny_model_dir)
    s = InferServer(cfg, RunDir(run_dir), 0)
    t = threading.Thread(target=s.serve)
    t.start()
    yield s
    s.stopping = True
    t.join()
    s.close()


def busy(endpoint: str) -> int:
    client = RpcClient(endpoint)
    try:
        reply = client.call(HealthRequest(request_id=new_request_id()), timeout_s=30)
        assert isinstance(reply, HealthResponse)
        return reply.num_running + reply.num_waiting
    finally:
        client.close()


def long_request(pool: InferPool) -> GenerateRequest:
    return GenerateRequest(request_id=pool.new_request_id(), prompt_ids=[5, 6, 7],
                           sampling=SamplingParams(max_tokens=250, ignore_eos=True, n=16))


def test_timed_out_and_predecessor_requests_stop_decoding(server, tmp_path):
    endpoint = server.server.endpoint
    aborted = lambda: server.engine.stats()["num_aborted"]  # noqa: E731
    first = InferPool(server.run, [endpoint], request_timeout_s=0.0)
    wait_until(lambda: first.submit(long_request(first)), 30, "connected")
    wait_until(lambda: busy(endpoint) > 0, 30, "the request running")
    assert len(first.expired()) == 1
    wait_until(lambda: aborted() == 1, 30, "the timed-out request aborted on the server")
    assert busy(endpoint) == 0

    mine = long_request(first)  # then this orchestrator dies; its successor connects
    assert first.submit(mine)
    wait_until(lambda: mine.request_id in server.clients, 30, "the request running")
    second = InferPool(server.run, [endpoint], request_timeout_s=300.0)
    theirs = long_request(second)
    wait_until(lambda: second.submit(theirs), 30, "connected")
    wait_until(lambda: aborted() == 2, 30, "the predecessor's request aborted")
    wait_until(lambda: theirs.request_id in server.clients, 30, "the successor's request running")
    assert mine.request_id not in server.clients
    second.abort([theirs.request_id])
    first.close()
    second.close()
