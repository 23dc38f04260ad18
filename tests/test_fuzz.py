"""Every ZeroMQ endpoint survives 10,000 random and mutated messages and then answers correctly.

rl-infer and rl-cache run as real processes on 127.0.0.1. Before the fuzzing each gets a well-formed
request whose answer is recorded; after it, the same request must get the same answer (a seeded
generation, a stored block), and the process must still be alive and registered.
"""

import pytest
from fuzz import blast
from procs import Procs, serve_initial_policy, wait_until, write_recipe

from rlcli.protocol import (
    CacheGet, CacheGetReply, CachePut, CacheReply, ErrorReply, GenerateRequest, GenerateResponse, HealthRequest,
    HealthResponse, LoadWeights, NcclWeights, SamplingParams, TensorSpec,
)
from rlcli.transport.registry import list_entries
from rlcli.transport.zmq import DEFAULT_MAX_MESSAGE_BYTES, RpcClient

NUM_MESSAGES = 10_000
pytestmark = pytest.mark.slow


def endpoint(run_dir, role: str, procs: Procs) -> str:
    entries = wait_until(lambda: list_entries(run_dir / "registry", role), 120, f"{role} registered", procs)
    return entries[0].endpoints["rpc"]


def probe_generate(client: RpcClient) -> list[int]:
    request = GenerateRequest(request_id="probe", prompt_ids=[5, 6, 7, 8],
                              sampling=SamplingParams(max_tokens=6, seed=123, ignore_eos=True))
    reply = client.call(request, timeout_s=60, peer="rl-infer")
    assert isinstance(reply, GenerateResponse), reply
    return reply.completions[0].token_ids


def test_endpoints_survive_fuzzing(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, cache={"capacity_mb": 64},
                          sync={"ack_timeout_s": 1.0})  # bounds each collective load the fuzzer asks for
    serve_initial_policy(run_dir, tiny_model_dir)
    procs = Procs(tmp_path / "logs")
    try:
        infer, cache = procs.start("infer-0", recipe, "--id", "0"), procs.start("cache", recipe)
        infer_ep, cache_ep = endpoint(run_dir, "infer", procs), endpoint(run_dir, "cache", procs)
        assert infer_ep.startswith("tcp://127.0.0.1:") and cache_ep.startswith("tcp://127.0.0.1:")

        infer_client, cache_client = RpcClient(infer_ep), RpcClient(cache_ep)
        before = probe_generate(infer_client)
        put = cache_client.call(CachePut(request_id="p", keys=[b"probe"], values=[b"block"]), 10, "rl-cache")
        assert isinstance(put, CacheReply) and put.num_stored == 1

        for name, ep, seed in (("rl-infer", infer_ep, 1), ("rl-cache", cache_ep, 2)):
            counts = blast(ep, seed=seed, count=NUM_MESSAGES, oversized_bytes=DEFAULT_MAX_MESSAGE_BYTES + 1)
            assert counts["sent"] == NUM_MESSAGES
            assert counts["errors"] > NUM_MESSAGES // 2, (name, counts)  # most are refused, each with a reply

        assert infer.poll() is None and cache.poll() is None, procs.logs()
        # A collective load naming an unreachable store with a 68-year deadline is answered once the
        # server's own sync.ack_timeout_s has passed (it held the serving loop for good before).
        ref = NcclWeights(group="g", store="127.0.0.1:1", rank=1, world_size=2, timeout_s=2.0**31,
                          tensors=[TensorSpec(name="model.embed_tokens.weight", dtype="float32", shape=[3])])
        reply = infer_client.call(LoadWeights(request_id="l", version=1, weights=ref), 60, "rl-infer")
        assert isinstance(reply, ErrorReply), reply
        assert isinstance(infer_client.call(HealthRequest(request_id="h"), 30, "rl-infer"), HealthResponse)
        assert probe_generate(infer_client) == before
        got = cache_client.call(CacheGet(request_id="g", keys=[b"probe"]), 10, "rl-cache")
        assert isinstance(got, CacheGetReply) and got.values == [b"block"]
        infer_client.close()
        cache_client.close()
    finally:
        procs.stop_all()

