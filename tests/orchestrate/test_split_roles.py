"""Prefill/decode disaggregation as processes: rl-cache, one `rl-infer --role prefill`, one
`rl-infer --role decode`, and the orchestrator's pool routing each request through both. The
decode server's answer equals a single mixed server's for the same seeds."""

import time

import pytest
from procs import Procs, serve_initial_policy, wait_until, write_recipe

from rlcli.config import load_recipe
from rlcli.errors import ConfigError
from rlcli.infer.engine import NativeEngine
from rlcli.orchestrate.pool import InferPool
from rlcli.protocol import GenerateRequest, GenerateResponse, HealthRequest, HealthResponse, SamplingParams
from rlcli.transport.registry import list_entries
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcClient



@pytest.mark.slow
def test_pool_routes_prefill_then_decode_and_decode_matches_single_server(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, cache={"capacity_mb": 16},
                          model={"path": str(tiny_model_dir), "max_seq_len": 128})
    serve_initial_policy(run_dir, tiny_model_dir)
    procs = Procs(tmp_path / "logs")
    requests = [GenerateRequest(request_id=f"r{i}", prompt_ids=[256] + list(range(30 + i, 90 + i)), cache_salt="0",
                                sampling=SamplingParams(max_tokens=10, seed=11 + i, ignore_eos=True))
                for i in range(3)]
    try:
        procs.start("cache", recipe)
        procs.start("infer-0", recipe, "--id", "0", "--role", "prefill", "--kv-cache", "registry")
        procs.start("infer-1", recipe, "--id", "1", "--role", "decode", "--kv-cache", "registry")
        entries = wait_until(lambda: len(list_entries(run_dir / "registry", "infer")) == 2
                             and list_entries(run_dir / "registry", "infer"), 120, "two rl-infer servers", procs)
        assert sorted(e.info["role"] for e in entries) == ["decode", "prefill"]
        fixed = InferPool(RunDir(run_dir), [e.endpoints["rpc"] for e in entries], request_timeout_s=120)
        fixed.check_reachable()  # --connect endpoints: each one's role from its health answer
        assert [s.role for s in fixed.servers.values()] == [e.info["role"] for e in entries]
        fixed.close()
        pool = InferPool(RunDir(run_dir), [], request_timeout_s=120)
        pool.refresh()
        for r in requests:
            wait_until(lambda: pool.submit(r), 30, "a connection to the prefill server")
        replies = {}
        deadline = time.monotonic() + 120
        while len(replies) < len(requests) and time.monotonic() < deadline:
            for req, reply, _ in pool.poll(100):
                replies[req.request_id] = reply
        assert all(isinstance(r, GenerateResponse) for r in replies.values()), (replies, procs.logs())
        health = {}
        for e in entries:
            client = RpcClient(e.endpoints["rpc"])
            reply = client.call(HealthRequest(request_id="h"), 30, "rl-infer")
            assert isinstance(reply, HealthResponse)
            health[e.info["role"]] = reply.stats
            client.close()
        pool.close()
    finally:
        procs.stop_all()
    # The prefill server answered one token per request (to the pool, not to us); the decode
    # server took every prompt's full blocks from the store and generated the completions.
    assert health["prefill"]["num_generated_tokens"] == 3 and health["prefill"]["kv_published_blocks"] > 0
    assert health["decode"]["num_kv_fetched_tokens"] > 0 and health["decode"]["num_generated_tokens"] == 30
    cfg = load_recipe(recipe)
    single = NativeEngine.from_config(cfg, run_dir / "weights" / "step_0", 0, instance=7)
    for r in requests:
        single.add_request(r)
    ref = {}
    while single.has_work():
        for out in single.step():
            ref[out.request_id] = out
    for rid, resp in ref.items():
        assert replies[rid].completions[0].token_ids == resp.completions[0].token_ids
        assert max(abs(a - b) for a, b in zip(replies[rid].completions[0].logprobs,
                                              resp.completions[0].logprobs)) < 1e-5
    single.close()


def test_up_launches_prefill_and_decode_servers(tmp_path, tiny_model_dir):
    from rlcli.orchestrate.launcher import Launcher

    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run", up={"num_infer": 3, "num_prefill": 1})
    launcher = Launcher(load_recipe(recipe), RunDir(tmp_path / "run"))
    assert launcher.role_args(0) == ["--role", "prefill", "--kv-cache", "registry"]
    assert launcher.role_args(2) == ["--role", "decode", "--kv-cache", "registry"]
    no_cache = write_recipe(tmp_path / "n.toml", tiny_model_dir, tmp_path / "run",
                            up={"num_infer": 2, "num_prefill": 1, "processes": ["infer", "train", "orchestrate"]})
    with pytest.raises(ConfigError, match="up.num_prefill needs a shared KV store"):
        Launcher(load_recipe(no_cache), RunDir(tmp_path / "run")).role_args(0)
    with pytest.raises(Exception, match="up.num_prefill"):
        load_recipe(write_recipe(tmp_path / "b.toml", tiny_model_dir, tmp_path / "run",
                                 up={"num_infer": 2, "num_prefill": 2}))


class _Recorder:
    """A server handle that records what the pool sends it."""

    def __init__(self, key: str, role: str):
        self.key, self.role, self.num_outstanding, self.sent, self.version = key, role, 0, [], None

    def send(self, msg) -> bool:
        self.sent.append(msg.request_id)
        return True


def test_a_prefill_server_never_takes_a_request_whose_answer_is_the_callers(tmp_path):
    """A prefill server answers one token: alone, it gets nothing (the request waits for a decode server);
    beside one, it takes the first hop and the decode server the second; decode servers alone serve as
    mixed ones."""
    pool = InferPool(RunDir(tmp_path / "run"), [], 60.0)
    prefill = _Recorder("infer-0", "prefill")
    pool.servers = {"infer-0": prefill}
    req = GenerateRequest(request_id=pool.new_request_id(), prompt_ids=[1, 2, 3],
                          sampling=SamplingParams(max_tokens=4, n=2))
    assert not pool.submit(req) and prefill.sent == []
    decode = pool.servers["infer-1"] = _Recorder("infer-1", "decode")
    assert pool.submit(req) and prefill.sent == [req.request_id] and pool.outstanding[req.request_id].prefill
    pool.outstanding.pop(req.request_id)  # the prefill server answered
    pool._hand_off(req)
    assert decode.sent == [req.request_id] and not pool.outstanding[req.request_id].prefill
    del pool.servers["infer-0"]
    other = GenerateRequest(request_id=pool.new_request_id(), prompt_ids=[4], sampling=SamplingParams(max_tokens=4))
    assert pool.submit(other) and decode.sent[-1] == other.request_id
