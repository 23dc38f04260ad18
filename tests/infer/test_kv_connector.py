"""The engine's KVConnector against a real rl-cache process: fetch on a local miss, publish
off the decode path, prefill/decode roles, and other weights never sharing KV."""

import signal
import time

import pytest
import torch
from kvstore import PREFIX, TAILS, engine, requests, run, start_cache

from rlcli.cache.client import CacheClient
from rlcli.config.infer import KVCacheConfig
from rlcli.infer import shared_kv
from rlcli.infer.engine import NativeEngine
from rlcli.infer.kv_connector import make_kv_connector
from rlcli.models import load_model, save_model
from rlcli.protocol import FsWeights, GenerateRequest, SamplingParams
from rlcli.transport.atomic import write_marker


@pytest.fixture
def cache(tmp_path):
    proc, endpoint = start_cache(tmp_path)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.parametrize("transfer", ["arena", "shm", "inline"])
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
    # the timing counters docs/guide/rl-cache.md names: a fetch took time, waiting on the store within it
    assert stats["kv_fetch_s"] >= stats["kv_fetch_store_s"] > 0 and stats["kv_fetch_idle_s"] >= 0
    assert a.stats()["kv_publish_engine_s"] > 0
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
    if transfer == "arena":  # B copied the leased slots into its blocks and released them
        client = CacheClient(cache)
        deadline = time.monotonic() + 10
        while client.stats()["leased"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats()["leased"] == 0 and b.stats()["kv_fetch_errors"] == 0
        client.close()
    for e in (a, b, solo):
        e.close()


def test_an_moe_replica_fetches_blocks_with_their_routes_for_r3(cache):
    """A mixture-of-experts engine's blocks carry their tokens' routes through the store: a replica
    that never saw the prefix fetches it for R3 requests and returns the routes (and tokens) an
    engine that computed everything returns."""
    from pathlib import Path

    import msgspec

    model = load_model(Path(__file__).resolve().parents[2] / "recipes/models/tiny-qwen3-moe", seed=3)
    a, b, solo = engine(model, cache), engine(model, cache), engine(model, None)
    from rlcli.infer import kv_blocks

    kv_only = kv_blocks.block_meta(model, a.block_size, a.dtype)
    assert a.block_meta().nbytes >= kv_only.nbytes + kv_blocks.route_bytes(model, a.block_size) > kv_only.nbytes
    assert a.block_meta().fingerprint != kv_only.fingerprint

    def r3(reqs):
        return [msgspec.structs.replace(r, sampling=msgspec.structs.replace(r.sampling, return_routing=True))
                for r in reqs]

    run(a, r3(requests(PREFIX, TAILS[:1])))
    assert a.kv.flush(10) and a.stats()["kv_published_blocks"] >= 10
    out_b = run(b, r3(requests(PREFIX, TAILS)))
    ref = run(solo, r3(requests(PREFIX, TAILS)))
    assert b.stats()["num_kv_fetched_tokens"] >= 40
    # A prefill server hands a decode server the other prompts' blocks, routes included.
    prefill, decode = engine(model, cache, role="prefill"), engine(model, cache, role="decode")
    others = [[90, 91], [95, 96, 97, 98, 99, 100]]
    run(prefill, r3(requests([256] + list(range(100, 130)), others)))
    out_d = run(decode, r3(requests([256] + list(range(100, 130)), others)))
    ref_d = run(solo, r3(requests([256] + list(range(100, 130)), others)))
    assert decode.stats()["num_kv_fetched_tokens"] >= 28
    for out, want in ((out_b, ref), (out_d, ref_d)):
        for rid, resp in want.items():
            got, exp = out[rid].completions[0], resp.completions[0]
            assert got.token_ids == exp.token_ids
            assert got.routed_experts is not None and exp.routed_experts is not None
            assert (got.routed_experts.numpy() == exp.routed_experts.numpy()).all(), rid
    for e in (a, b, solo, prefill, decode):
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


def test_a_fetch_in_flight_never_stalls_other_requests(tiny_model_dir, tmp_path):
    """The store is stopped (SIGSTOP) while a prompt's fetch is in flight: another request
    keeps decoding; once the store answers, the prompt runs on the fetched blocks and its
    output equals a server's that never shared KV. A waiter aborted mid-fetch leaves the
    fetched blocks to the next prompt."""
    proc, endpoint = start_cache(tmp_path)
    model = load_model(tiny_model_dir, seed=1)
    a, b, solo = engine(model, endpoint), engine(model, endpoint), engine(model, None)
    run(a, requests(PREFIX, TAILS[:1]))
    assert a.kv.flush(10)
    b.kv.timeout_s = 120.0
    short = GenerateRequest(request_id="short", prompt_ids=[256, 5, 6], cache_salt="3",  # no full block: no fetch
                            sampling=SamplingParams(max_tokens=40, seed=1, ignore_eos=True))
    b.add_request(short)
    b.step()  # short is decoding now
    proc.send_signal(signal.SIGSTOP)
    try:
        waiter = requests(PREFIX, TAILS)[1]
        b.add_request(waiter)
        before = b.stats()["num_generated_tokens"]
        for _ in range(5):
            b.step()
        assert len(b.fetches) == 1 and not b.fetches[0].ticket.done()
        assert [s.req.request_id for s in b.waiting] == ["1"] and b.stats()["num_generated_tokens"] == before + 5
        b.abort("1")  # the fetch stays in flight; its blocks go to the local prefix cache
    finally:
        proc.send_signal(signal.SIGCONT)
    out = run(b, requests(PREFIX, TAILS[1:2]))  # the same prompt again, request id "0"
    assert not b.fetches and b.stats()["num_kv_fetched_tokens"] == 40 and b.stats()["kv_fetch_requests"] == 1
    assert out["0"].num_cached_tokens == 40 and len(out["short"].completions[0].token_ids) == 40
    ref = run(solo, requests(PREFIX, TAILS[1:2]))
    assert out["0"].completions[0].token_ids == ref["0"].completions[0].token_ids
    torch.testing.assert_close(out["0"].completions[0].logprobs, ref["0"].completions[0].logprobs, rtol=0, atol=1e-5)
    for e in (a, b, solo):
        e.close()
    proc.terminate()
    proc.wait(timeout=10)


def test_a_fetch_in_flight_across_a_swap_is_dropped(tiny_model_dir, tmp_path):
    """Blocks fetched under the old weights are never used after a swap: the prompt asks
    again under the new ones and its output is the new weights' own."""
    proc, endpoint = start_cache(tmp_path)
    model, new_model = load_model(tiny_model_dir, seed=1), load_model(tiny_model_dir, seed=2)
    save_model(new_model, tmp_path / "v1")
    write_marker(tmp_path / "v1")
    a, b = engine(model, endpoint), engine(load_model(tiny_model_dir, seed=1), endpoint)
    solo = engine(new_model, None)
    run(a, requests(PREFIX, TAILS[:1]))
    assert a.kv.flush(10)
    b.kv.timeout_s = 120.0
    proc.send_signal(signal.SIGSTOP)
    try:
        b.add_request(requests(PREFIX, TAILS)[1])
        b.step()
        assert len(b.fetches) == 1 and not b.fetches[0].ticket.done()
        b.load_weights(FsWeights(path=str(tmp_path / "v1")), version=1)
    finally:
        proc.send_signal(signal.SIGCONT)
    out = run(b, [])
    stats = b.stats()
    assert stats["kv_fetched_blocks"] == 10 and stats["num_kv_fetched_tokens"] == 0  # fetched, then dropped
    assert stats["kv_fetch_requests"] == 2 and out["1"].num_cached_tokens == 0  # asked again under v1: a miss
    ref = run(solo, requests(PREFIX, TAILS)[1:2])
    assert out["1"].completions[0].token_ids == ref["1"].completions[0].token_ids
    assert out["1"].completions[0].versions == [1] * len(ref["1"].completions[0].token_ids)
    torch.testing.assert_close(out["1"].completions[0].logprobs, ref["1"].completions[0].logprobs, rtol=0, atol=1e-5)
    for e in (a, b, solo):
        e.close()
    proc.terminate()
    proc.wait(timeout=10)


def test_fetches_done_together_do_not_evict_one_another(tiny_model_dir, tmp_path, monkeypatch):
    """Three prompts' histories are in the store and B's cache holds two of them at a time:
    each prompt runs on the blocks fetched for it (taken just before its admission), none
    recomputes what the store held. Taken together at one step's start, the third fetch's
    blocks evicted the first's, and the first prompt recomputed them."""
    monkeypatch.setattr(shared_kv, "FETCH_HOLD_S", 600.0)  # a slow machine must not expire the third's wait
    proc, endpoint = start_cache(tmp_path)
    model = load_model(tiny_model_dir, seed=1)
    a = engine(model, endpoint)
    prompts = [GenerateRequest(request_id=str(i), prompt_ids=[256] + [20 + 50 * i + j for j in range(43)],
                               cache_salt="3", sampling=SamplingParams(max_tokens=4, seed=i, ignore_eos=True))
               for i in range(3)]
    run(a, prompts)  # 44 tokens each: 10 full blocks of 4 to fetch (the last one holds the prompt's end)
    assert a.kv.flush(10)
    b = NativeEngine(model, eos_token_ids=[], max_model_len=256, block_size=4, kv_cache_memory_mb=25 * 2048 / 2**20)
    b.kv = make_kv_connector(KVCacheConfig(endpoint=endpoint), b.block_meta(), b.device)
    assert b.blocks.num_blocks == 25
    for r in prompts:
        b.add_request(r)
    b.step()  # asks the store for each prompt's 10 blocks
    deadline = time.monotonic() + 30
    while not all(f.ticket.done() for f in b.fetches) and time.monotonic() < deadline:
        time.sleep(0.01)
    out = run(b, [])
    assert {rid: r.num_cached_tokens for rid, r in out.items()} == {"0": 40, "1": 40, "2": 40}
    assert b.stats()["num_kv_fetched_tokens"] == 120
    ref = run(engine(model, None), prompts)
    for rid, resp in ref.items():
        assert out[rid].completions[0].token_ids == resp.completions[0].token_ids
    for e in (a, b):
        e.close()
    proc.terminate()
    proc.wait(timeout=10)


def test_a_prompt_whose_kv_exceeds_the_publish_queue_reaches_the_store(tiny_model_dir, tmp_path, monkeypatch):
    """A long prompt's KV larger than the connector's whole publish queue (2 GiB: 64k tokens of
    a 1B model) goes in pieces, chunk by chunk, as the queue has room; published in one batch
    after the prefill, it was dropped whole and another replica recomputed all of it."""
    proc, endpoint = start_cache(tmp_path)
    model = load_model(tiny_model_dir, seed=1)
    a = NativeEngine(model, eos_token_ids=[], max_model_len=256, block_size=4, kv_cache_memory_mb=2,
                     max_num_batched_tokens=16)  # prefill chunks of 4 blocks
    nbytes = a.block_meta().nbytes  # the queue never holds the prompt's 41 blocks at once:
    a.kv = make_kv_connector(KVCacheConfig(endpoint=endpoint, publish_queue_mb=12 * nbytes / 2**20),
                             a.block_meta(), a.device)
    monkeypatch.setattr(shared_kv, "PUBLISH_PIECE_BYTES", 2 * nbytes)
    prompt = [GenerateRequest(request_id="0", prompt_ids=[256] + [20 + j for j in range(163)], cache_salt="3",
                              sampling=SamplingParams(max_tokens=4, seed=0, ignore_eos=True))]
    run(a, prompt)  # 164 tokens: 41 full blocks, the last one the prompt's end
    deadline = time.monotonic() + 30
    while a.publish_backlog and time.monotonic() < deadline:  # what the full queue left at the end
        assert a.kv.flush(10)
        a.publish_pending()
    assert a.kv.flush(10)
    stats = a.stats()
    assert stats["kv_publish_dropped"] == 0 and stats["kv_published_blocks"] == 41
    a.publish_backlog.append(([b"\0" * 16], [0]))  # a run whose block the local cache evicted
    a.publish_pending()
    assert not a.publish_backlog and a.kv.flush(10) and a.stats()["kv_published_blocks"] == 41
    b = engine(model, endpoint)
    out = run(b, prompt)
    assert b.stats()["num_kv_fetched_tokens"] == 160  # all but the block that holds the prompt's last token
    ref = run(engine(model, None), prompt)
    assert out["0"].completions[0].token_ids == ref["0"].completions[0].token_ids
    for e in (a, b):
        e.close()
    proc.terminate()
    proc.wait(timeout=10)
