"""rl-orchestrate across restarts and failures: retention never deletes a batch a restarting
trainer needs, a missing batch is written again, timed-out requests and a dead predecessor's
requests are aborted on the (real, in-process) rl-infer server; a request is given up only
when its server says it does not hold it, or does not answer."""

import threading
import time

import zmq

import pytest

from procs import serve_initial_policy, wait_until, write_recipe
from rlcli.config import load_recipe
from rlcli.errors import ConfigError
from rlcli.envs import Task
from rlcli.infer.server import InferServer
from rlcli.orchestrate.pool import InferPool, Outstanding
from rlcli.orchestrate.rollouts import Group
from rlcli.protocol import (BatchWritten, GenerateRequest, GenerateResponse, HealthRequest,
                            HealthResponse, SamplingParams)
from rlcli.protocol.messages import decode
from rlcli.protocol.batch import decode_batch
from rlcli.transport.atomic import atomic_dir, remove_dir
from rlcli.transport.registry import Registration
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


def test_a_milestone_checkpoint_holds_no_batches_back(tmp_path):
    run = RunDir(tmp_path)
    mark(run, "rollouts", range(1, 31))
    mark(run, "checkpoints", [10, 20, 28, 30])  # train.checkpoint.keep_every = 10 kept 10 and 20 for good
    run.write_progress("train", step=30)
    o = bare_orchestrator(1, 4, 40)
    o.run = run
    o.ocfg.keep_rollouts = 1
    o.cfg.train.checkpoint.keep = 2
    o._retain()
    assert run.stable_steps("rollouts") == list(range(29, 31))  # what a restart from 28 (or 30) needs


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

    def close(self) -> None:
        pass


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


def answers(pool: InferPool, request: GenerateRequest, timeout_s: float = 60):
    """Poll until ``request`` is answered; returns the reply and every request lost meanwhile."""
    lost, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lost += pool.lost()
        for req, reply, _ in pool.poll(20):
            if req.request_id == request.request_id:
                return reply, lost
    raise AssertionError("no reply")


def test_a_request_its_server_holds_is_never_given_up(server):
    """Decoding for many times request_timeout_s is fine while the server says it holds the request
    (before, any request older than the timeout was aborted and sent again, so no completion
    longer than request_timeout_s could ever finish)."""
    pool = InferPool(server.run, [server.server.endpoint], request_timeout_s=0.02)
    request = long_request(pool)
    wait_until(lambda: pool.submit(request), 30, "connected")
    t0 = time.monotonic()
    reply, lost = answers(pool, request)
    assert isinstance(reply, GenerateResponse) and lost == []
    assert time.monotonic() - t0 > 4 * pool.timeout_s and server.engine.stats()["num_aborted"] == 0
    pool.close()


def test_a_request_its_server_does_not_hold_is_sent_again(server):
    """A request lost on the way (here: recorded as sent, never delivered) is named by the server's
    answer to the next probe and handed back; one the server holds, sent before it, is not."""
    pool = InferPool(server.run, [server.server.endpoint], request_timeout_s=0.5)
    held = long_request(pool)
    wait_until(lambda: pool.submit(held), 30, "connected")
    vanished = long_request(pool)
    pool.outstanding[vanished.request_id] = Outstanding(vanished, "connect-0", time.monotonic())
    pool.servers["connect-0"].num_outstanding += vanished.sampling.n
    lost: list = []
    wait_until(lambda: (pool.poll(20), lost.extend(pool.lost()))[1] or lost, 30, "the loss found")
    assert lost == [vanished] and vanished.request_id not in pool.outstanding  # held: answered, or still held
    assert pool.servers["connect-0"].num_outstanding == sum(o.request.sampling.n for o in pool.outstanding.values())
    pool.abort(list(pool.outstanding))
    pool.close()


def test_a_server_that_does_not_answer_has_its_requests_aborted_and_sent_again():
    """A wedged server (here: a socket nobody serves) is asked, does not answer within
    request_timeout_s, and gets an abort for what it was sent; the requests come back."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    pool = InferPool(RunDir("."), [f"tcp://127.0.0.1:{port}"], request_timeout_s=0.3)
    request = long_request(pool)
    wait_until(lambda: pool.submit(request), 30, "connected")
    lost: list = []
    wait_until(lambda: (pool.poll(20), lost.extend(pool.lost()))[1] or lost, 30, "the requests given up")
    assert lost == [request] and pool.outstanding == {}
    received = []
    while router.poll(1000):
        received.append(decode(router.recv_multipart()[-1]))
    kinds = [type(m).__name__ for m in received]
    assert kinds == ["AbortRequests", "GenerateRequest", "HealthRequest", "AbortRequests"], kinds
    assert received[2].request_ids == [request.request_id] and received[3].request_ids == [request.request_id]
    router.close(linger=0)
    pool.close()


def test_predecessor_requests_stop_decoding(server):
    endpoint = server.server.endpoint
    aborted = lambda: server.engine.stats()["num_aborted"]  # noqa: E731
    first = InferPool(server.run, [endpoint], request_timeout_s=300.0)
    wait_until(lambda: first.submit(long_request(first)), 30, "connected")
    wait_until(lambda: busy(endpoint) > 0, 30, "the request running")
    first.abort(list(first.outstanding))
    wait_until(lambda: aborted() == 1, 30, "the request aborted on the server")
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


def test_a_trainer_with_another_data_parallel_size_is_refused(tmp_path):
    """rl-train registers its data-parallel size; batches split for another would leave ranks'
    files unread or missing, so rl-orchestrate stops with the setting to change."""
    run = RunDir(tmp_path)
    o = bare_orchestrator(1, 2, 30)
    o.run, o.next_step, o.rewrite = run, 1, []
    trainer = Registration(run.registry_dir(), "train", 0, {}, {"dp": 2})
    try:
        with pytest.raises(ConfigError, match="set orchestrate.num_train_ranks = 2 for rl-orchestrate"):
            o.find_missing()
        o.ocfg.num_train_ranks = 2
        o.find_missing()
    finally:
        trainer.close()


def test_a_run_without_rl_sync_says_what_it_waits_for(tmp_path, tiny_model_dir, caplog):
    """No policy is announced without rl-sync, so nothing is dispatched: one line says so."""
    import logging

    from rlcli.orchestrate.loop import Orchestrator

    run_dir = tmp_path / "run"
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir))
    RunDir(run_dir).claim("t", {})
    o = Orchestrator(cfg, RunDir(run_dir))
    try:
        with caplog.at_level(logging.INFO, logger="rl-orchestrate"):
            o.refresh()
            o.refresh()
        assert caplog.text.count("waiting for rl-sync to announce the first policy: none is registered") == 1
    finally:
        o.close()


def test_repeated_rejections_back_off_new_groups_and_are_logged_sparingly(caplog):
    """A rejection that repeats (a setting the server refuses for every request) was re-dispatched as
    fast as it came back, one error line each: new groups now wait, twice as long after each
    rejection in a row (up to 10 s), and the lines thin out to the powers of two."""
    from rlcli.orchestrate import loop
    from rlcli.protocol import ErrorReply
    from test_epochs import Held

    o = bare_orchestrator(1, 2, 30)
    o.pool = Held()
    o.http = None
    o.dispatch()
    requests = {r.request_id: r for r in o.unsent}
    assert len(o.inflight) == 4
    loop.log.addHandler(caplog.handler)  # rl-orchestrate's logger may not propagate
    try:
        for i, rid in enumerate(list(o.inflight)):
            t0 = time.monotonic()
            o.on_reply(requests[rid], ErrorReply(request_id=rid, message="no routes here"))
            assert o.dispatch_after - t0 == pytest.approx(0.1 * 2 ** i, abs=0.05)
            o.dispatch()
            assert len(o.inflight) == 3 - i  # nothing new while it waits
        o.dispatch_after = 0.0
        o.dispatch()
        assert len(o.inflight) == 4
        requests = {r.request_id: r for r in o.unsent}
        for rid in list(o.inflight):  # rejections 5 to 8 in a row: only the 8th is logged
            o.on_reply(requests[rid], ErrorReply(request_id=rid, message="no routes here"))
    finally:
        loop.log.removeHandler(caplog.handler)
    said = {r.getMessage() for r in caplog.records if "no routes here" in r.getMessage()}
    assert len(said) == 5 and any("(8 in a row)" in m for m in said) and not any("(5 in a row)" in m for m in said)
    o.dispatch_after = 0.0
    o.dispatch()
    assert len(o.inflight) == 4
    o.error_streak = 20
    rid = next(iter(o.inflight))
    o.on_reply(next(r for r in o.unsent if r.request_id == rid), ErrorReply(request_id=rid, message="x"))
    assert o.dispatch_after - time.monotonic() == pytest.approx(loop.MAX_ERROR_BACKOFF_S, abs=0.05)
