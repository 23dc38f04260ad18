"""The engine's KVConnector against a real rl-cache process: fetch on a local miss, publish
off the decode path, prefill/decode roles, and other weights never sharing KV."""

import subprocess
import sys
import time

import pytest
import torch

from rlcli.config.infer import KVCacheConfig
from rlcli.infer.engine import NativeEngine
from rlcli.infer.kv_connector import make_kv_connector
from rlcli.models import load_model
from rlcli.protocol import GenerateRequest, SamplingParams
from rlcli.transport.registry import list_entries


def start_cache(tmp_path, *args: str):
    run_dir = tmp_path / f"cache-run-{len(list(tmp_path.iterdir()))}"
    proc = subprocess.Popen([sys.executable, "-m", "rlcli.cli.cache", "serve", "--run-dir", str(run_dir),
                             "--capacity-mb", "64", *args], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (entries := list_entries(run_dir / "registry", "cache")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(proc.stderr.read() if proc.poll() is not None else "rl-cache did not register")
        time.sleep(0.05)
    return proc, entries[0].endpoints["rpc"]


@pytest.fixture
def cache(tmp_path):
    proc, endpoint = start_cache(tmp_path)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


def engine(model, endpoint: str | None, role: str = "mixed", transfer: str = "auto", seed: int = 0) -> NativeEngine:
    e = NativeEngine(model, eos_token_ids=[], max_model_len=256, block_size=4, seed=seed, role=role)
    if endpoint:
        e.kv = make_kv_connector(KVCacheConfig(endpoint=endpoint, transfer=transfer), e.block_meta())
    return e


def run(e: NativeEngine, requests: list[GenerateRequest]) -> dict:
    for r in requests:
        e.add_request(r)
    out = {}
    while e.has_work():
        for resp in e.step():
            out[resp.request_id] = resp
    return out


def requests(prefix: list[int], tails: list[list[int]], max_tokens=8, seed=7, temperature=1.0):
    return [GenerateRequest(request_id=str(i), prompt_ids=prefix + t, cache_salt="3",
                            sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i))
            for i, t in enumerate(tails)]


PREFIX = [256] + list(range(20, 60))  # 41 tokens: 10 full blocks of 4
TAILS = [[61, 62, 63], [70, 71], [80, 81, 82, 83, 84]]


@pytest.mark.parametrize("transfer", ["shm", "inline"])
def test_second_replica_fetches_the_prefix_and_matches(tiny_model_dir, cache, transfer):
    model = load_model(tiny_model_dir, seed=1)
    a, b, solo = engine(model, cache, transfer=transfer), engine(model, cache, transfer=transfer), engine(model, None)
    out_a = run(a, requests(PREFIX, TAILS[:1]))
    assert a.kv.flush(10) and a.stats()["kv_published_blocks"] >= 10
    # B has never seen the prefix: it fetches the store's blocks instead of computing them.
    out_b = run(b, requests(PREFIX, TAILS))
    ref = run(solo, requests(PREFIX, TAILS))
    stats = b.stats()
    assert stats["num_kv_fetched_tokens"] >= 40 and stats["kv_fetched_blocks"] >= 10
    for rid, resp in ref.items():
        got = out_b[rid].completions[0]
        assert got.token_ids == resp.completions[0].token_ids
        torch.testing.assert_close(got.logprobs, resp.completions[0].logprobs, rtol=0, atol=1e-5)
    assert out_a["0"].completions[0].token_ids == ref["0"].completions[0].token_ids
    # The fetched blocks hold exactly the KV A computed (bit for bit).
    hashes = b.blocks.block_hashes(PREFIX, "3|w0")
    blocks_a = [a.blocks.hash_to_block[h] for h in hashes]
    blocks_b = [b.blocks.hash_to_block[h] for h in hashes]
    assert torch.equal(a._gather_blocks(blocks_a), b._gather_blocks(blocks_b))
    for e in (a, b, solo):
        e.close()


def test_other_weights_and_salts_never_fetch(tiny_model_dir, cache):
    model = load_model(tiny_model_dir, seed=1)
    other = load_model(tiny_model_dir, seed=2)  # same architecture, other weights
    a, b = engine(model, cache), engine(other, cache)
    assert a.block_meta().fingerprint != b.block_meta().fingerprint
    run(a, requests(PREFIX, TAILS[:1]))
    a.kv.flush(10)
    run(b, requests(PREFIX, TAILS[:1]))
    assert b.stats()["num_kv_fetched_tokens"] == 0
    c = engine(model, cache)  # same weights, another salt
    reqs = requests(PREFIX, TAILS[:1])
    reqs[0].cache_salt = "4"
    run(c, reqs)
    assert c.stats()["num_kv_fetched_tokens"] == 0
    for e in (a, b, c):
        e.close()


def test_decode_server_matches_a_single_server(tiny_model_dir, cache):
    model = load_model(tiny_model_dir, seed=1)
    prefill, decode = engine(model, cache, role="prefill"), engine(model, cache, role="decode", seed=5)
    single = engine(model, None, seed=9)
    reqs = requests(PREFIX, TAILS, max_tokens=12)
    first = run(prefill, reqs)  # answered only once the prompt blocks are stored
    assert all(len(r.completions) == 1 and len(r.completions[0].token_ids) == 1 for r in first.values())
    out = run(decode, requests(PREFIX, TAILS, max_tokens=12))
    ref = run(single, requests(PREFIX, TAILS, max_tokens=12))
    # Every full block of every prompt came from the store (or from the blocks it fetched before).
    assert decode.stats()["num_cached_tokens"] == sum((len(PREFIX + t) - 1) // 4 * 4 for t in TAILS)
    assert decode.stats()["num_kv_fetched_tokens"] == 44  # the shared prefix once, then prompt 2's own block
    assert decode.stats()["num_prompt_tokens"] == sum(len(PREFIX + t) for t in TAILS)
    for rid, resp in ref.items():
        assert out[rid].completions[0].token_ids == resp.completions[0].token_ids
        assert first[rid].completions[0].token_ids == resp.completions[0].token_ids[:1]
        torch.testing.assert_close(out[rid].completions[0].logprobs, resp.completions[0].logprobs, rtol=0, atol=1e-5)
    for e in (prefill, decode, single):
        e.close()


def test_unreachable_store_is_a_miss_not_a_crash(tiny_model_dir, tmp_path):
    proc, endpoint = start_cache(tmp_path)
    model = load_model(tiny_model_dir, seed=1)
    e = engine(model, endpoint)
    e.kv.timeout_s = 0.5
    proc.kill()
    proc.wait()
    out = run(e, requests(PREFIX, TAILS[:2], max_tokens=3))
    assert len(out) == 2 and e.stats()["kv_fetch_errors"] >= 1
    e.close()
