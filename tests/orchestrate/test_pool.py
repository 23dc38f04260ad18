"""InferPool's choice of server: of those that serve the policy, the least loaded one, or the one
a later turn prefers (it holds the episode's earlier turns in its prefix cache) while that one is
not much busier."""

import zmq
from procs import wait_until

from rlcli.orchestrate.pool import AFFINITY_SLACK, InferPool
from rlcli.protocol import GenerateRequest, SamplingParams
from rlcli.protocol.messages import decode
from rlcli.transport.registry import Registration
from rlcli.transport.rundir import RunDir


def request(pool: InferPool, n: int) -> GenerateRequest:
    return GenerateRequest(request_id=pool.new_request_id(), prompt_ids=[1, 2], sampling=SamplingParams(n=n))


def received(router) -> list[str]:
    ids = []
    while router.poll(200):
        msg = decode(router.recv_multipart()[-1])
        if isinstance(msg, GenerateRequest):
            ids.append(msg.request_id)
    return ids


def test_a_preferred_server_takes_requests_until_it_is_much_busier_than_the_least_loaded(tmp_path):
    ctx = zmq.Context.instance()
    routers = [ctx.socket(zmq.ROUTER) for _ in range(2)]
    ports = [r.bind_to_random_port("tcp://127.0.0.1") for r in routers]
    pool = InferPool(RunDir(tmp_path), [f"tcp://127.0.0.1:{p}" for p in ports], request_timeout_s=300)
    try:
        wait_until(lambda: all(s.client.sock.poll(0, zmq.POLLOUT) for s in pool.servers.values()), 30, "connected")
        first = request(pool, 40)
        assert pool.submit(first)  # a tie: the first server
        far = request(pool, 1)  # preferred server at 40 sequences, the other at 0: 40 > 0 * 3 // 2 + 32
        assert pool.submit(far, prefer="connect-0")
        assert [s.num_outstanding for s in pool.servers.values()] == [40, 1] and AFFINITY_SLACK == 32
        sticky, plain = request(pool, 1), request(pool, 1)
        assert pool.submit(sticky, prefer="connect-1") and pool.submit(plain)
        pool.servers["connect-0"].num_outstanding = 35  # the other now at 3: 35 <= 3 * 3 // 2 + 32 = 36
        close = request(pool, 1)
        assert pool.submit(close, prefer="connect-0")
        assert pool.submit(request(pool, 1), prefer="gone")  # an unknown server is no preference
        assert received(routers[0]) == [first.request_id, close.request_id]
        assert received(routers[1])[:3] == [far.request_id, sticky.request_id, plain.request_id]
    finally:
        pool.close()
        for r in routers:
            r.close(linger=0)


def test_servers_behind_the_policy_take_no_requests(tmp_path, caplog):
    """A server rl-sync skipped, or one restarted on an older policy, would generate tokens too old
    for the batches: requests wait for a server that serves the orchestrator's policy."""
    ctx = zmq.Context.instance()
    routers = [ctx.socket(zmq.ROUTER) for _ in range(2)]
    ports = [r.bind_to_random_port("tcp://127.0.0.1") for r in routers]
    run = RunDir(tmp_path)
    regs = [Registration(run.registry_dir(), "infer", i, {"rpc": f"tcp://127.0.0.1:{p}"}, {"version": v})
            for i, (p, v) in enumerate(zip(ports, [1, 2]))]
    pool = InferPool(run, [], request_timeout_s=300)
    try:
        assert pool.refresh() == []
        wait_until(lambda: all(s.client.sock.poll(0, zmq.POLLOUT) for s in pool.servers.values()), 30, "connected")
        pool.serve_at_least(2)
        busy = request(pool, 40)
        assert pool.submit(busy) and pool.submit(request(pool, 1))  # both to infer-1, the one at v2
        assert pool.servers["infer-0"].num_outstanding == 0 and pool.servers["infer-1"].num_outstanding == 41
        pool.serve_at_least(3)
        waiting = request(pool, 1)
        assert not pool.submit(waiting)
        assert "no rl-infer server serves policy v3 yet (infer-0 serves v1, infer-1 serves v2)" in caplog.text
        regs[0].update(version=3)  # rl-sync brought infer-0 up to date
        pool.refresh()
        assert pool.submit(waiting)
        assert received(routers[0]) == [waiting.request_id] and len(received(routers[1])) == 2
    finally:
        pool.close()
        for r in routers:
            r.close(linger=0)
        for reg in regs:
            reg.close()
