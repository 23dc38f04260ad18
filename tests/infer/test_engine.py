import pytest
import torch

from rlcli.infer.block_manager import BlockManager
from rlcli.infer.engine import NativeEngine
from rlcli.models import load_model, save_model
from rlcli.protocol import FsWeights, GenerateRequest, SamplingParams
from rlcli.transport.atomic import write_marker


@pytest.fixture
def model(tiny_model_dir):
    return load_model(tiny_model_dir, seed=1)


def run_all(engine: NativeEngine) -> dict:
    out = {}
    while engine.has_work():
        for r in engine.step():
            out[r.request_id] = r
    return out


@torch.no_grad()
def greedy_reference(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def prompts(k, start=10):
    return [[256] + list(range(start + i, start + 9 + 3 * i)) for i in range(k)]


@pytest.mark.parametrize("kwargs", [
    {},  # plenty of memory
    {"kv_cache_memory_mb": 0.03, "block_size": 4},  # forces preemption and recompute
    {"max_num_batched_tokens": 8, "block_size": 4},  # chunked prefill
    {"max_num_seqs": 3},
])
def test_greedy_matches_full_forward(model, kwargs):
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, **kwargs)
    ps = prompts(6)
    for i, p in enumerate(ps):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p,
                                           sampling=SamplingParams(temperature=0.0, max_tokens=10, n=1 + i % 3)))
    out = run_all(engine)
    assert sorted(out) == [str(i) for i in range(6)]
    for rid, resp in out.items():
        ref = greedy_reference(model, ps[int(rid)], 10)
        assert len(resp.completions) == 1 + int(rid) % 3
        for c in resp.completions:
            assert c.token_ids == ref and c.finish_reason == "length" and c.versions == [0] * 10
    if "kv_cache_memory_mb" in kwargs:
        assert engine.stats()["num_preemptions"] > 0
    assert engine.blocks.num_available == engine.blocks.num_blocks  # every block came back


def test_max_num_seqs_counts_the_completions_a_prompt_forks_into(model):
    """A prompt with n completions takes n of the max_num_seqs slots when it is admitted (it forks
    at the end of its prefill), and n above the cap is refused when the request is added."""
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, max_num_seqs=4)
    for i, p in enumerate(prompts(4)):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p,
                                           sampling=SamplingParams(temperature=0.0, max_tokens=5, n=3)))
    out, most = {}, 0
    while engine.has_work():
        out.update({r.request_id: r for r in engine.step()})
        most = max(most, sum(1 if s.index >= 0 else s.req.sampling.n for s in engine.running))
    assert most == 3 and sorted(out) == ["0", "1", "2", "3"]
    assert all(len(r.completions) == 3 for r in out.values())
    with pytest.raises(ValueError, match="sampling.n 5 exceeds infer.max_num_seqs 4"):
        engine.add_request(GenerateRequest(request_id="x", prompt_ids=prompts(1)[0],
                                           sampling=SamplingParams(max_tokens=5, n=5)))


def test_top_p_importance_ratio_is_one_with_equal_weights(model):
    """Engine logprobs are of the truncated, renormalized nucleus; the trainer recomputes the
    same distribution, so with the same weights every token's ratio is 1."""
    from rlcli.train.loss import token_logprobs

    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128)
    prompt = [256, 5, 6, 7]
    engine.add_request(GenerateRequest(request_id="s", prompt_ids=prompt,
                                       sampling=SamplingParams(temperature=0.7, top_p=0.5, max_tokens=8, n=3)))
    resp = run_all(engine)["s"]
    truncated = 0
    for c in resp.completions:
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = model(ids)
            lp, _ = token_logprobs(logits, ids, 0.7, top_p=0.5)
            full, _ = token_logprobs(logits, ids, 0.7)
        trainer = lp[0, len(prompt):]
        ratio = (trainer - torch.tensor(c.logprobs)).exp()
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4)
        truncated += int((full[0, len(prompt):] < trainer - 1e-3).sum())
    assert truncated > 0  # the nucleus really cut mass off (the test would pass vacuously otherwise)


def test_seeded_requests_reproduce_whatever_the_batch(model):
    def sample(with_others: bool):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, seed=123 if with_others else 7)
        if with_others:
            for i, p in enumerate(prompts(3, start=40)):
                engine.add_request(GenerateRequest(request_id=f"o{i}", prompt_ids=p,
                                                   sampling=SamplingParams(max_tokens=6, n=2)))
        engine.add_request(GenerateRequest(request_id="x", prompt_ids=[256, 1, 2, 3],
                                           sampling=SamplingParams(max_tokens=12, n=2, seed=99)))
        return [c.token_ids for c in run_all(engine)["x"].completions]

    assert sample(False) == sample(True)


def test_stop_tokens_and_eos(model):
    ref = greedy_reference(model, [256, 1, 2], 8)
    stop = ref[3]
    engine = NativeEngine(model, eos_token_ids=[stop], max_model_len=128)
    engine.add_request(GenerateRequest(request_id="eos", prompt_ids=[256, 1, 2],
                                       sampling=SamplingParams(temperature=0, max_tokens=8)))
    engine.add_request(GenerateRequest(request_id="ignore", prompt_ids=[256, 1, 2],
                                       sampling=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    engine.add_request(GenerateRequest(request_id="stop", prompt_ids=[256, 1, 2],
                                       sampling=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                               stop_token_ids=[ref[1]])))
    out = run_all(engine)
    first = ref.index(stop)
    assert out["eos"].completions[0].token_ids == ref[:first + 1]
    assert out["eos"].completions[0].finish_reason == "stop"
    assert out["ignore"].completions[0].token_ids == ref
    assert out["stop"].completions[0].token_ids == ref[:ref.index(ref[1]) + 1]


def test_max_model_len_ends_a_completion(model):
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=12)
    engine.add_request(GenerateRequest(request_id="r", prompt_ids=[256] + list(range(1, 9)),
                                       sampling=SamplingParams(max_tokens=50)))
    c = run_all(engine)["r"].completions[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"


def test_bad_requests_are_rejected(model):
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=16, max_num_seqs=10**7)
    for prompt, match in [([], "empty"), (list(range(20)), "max_model_len"), ([100000], r"\[0, 259\)")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(GenerateRequest(request_id="b", prompt_ids=prompt))
    with pytest.raises(ValueError, match="KV blocks"):  # refused up front, not a crash in a later step
        engine.add_request(GenerateRequest(request_id="n", prompt_ids=[1], sampling=SamplingParams(n=10**6)))


def test_a_request_the_cache_cannot_hold_is_rejected_not_fatal(model):
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, kv_cache_memory_mb=0.03, block_size=4)
    capacity = engine.blocks.num_blocks * 4
    with pytest.raises(ValueError, match="kv_cache_memory_mb"):
        engine.add_request(GenerateRequest(request_id="big", prompt_ids=[1] * 8,
                                           sampling=SamplingParams(max_tokens=capacity)))
    with pytest.raises(ValueError, match="KV blocks"):  # n - 1 partial-block copies at the fork
        engine.add_request(GenerateRequest(request_id="wide", prompt_ids=[1] * (capacity - 5),
                                           sampling=SamplingParams(max_tokens=2, n=8)))
    engine.add_request(GenerateRequest(request_id="fits", prompt_ids=[1] * 8,
                                       sampling=SamplingParams(max_tokens=capacity - 8)))
    assert len(run_all(engine)["fits"].completions[0].token_ids) == capacity - 8


def test_prefix_cache_is_salted(model):
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, block_size=4)
    prompt = [256] + list(range(1, 30))
    sp = SamplingParams(temperature=0, max_tokens=2)

    def cached(rid, salt):
        engine.add_request(GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=sp, cache_salt=salt))
        return run_all(engine)[rid]

    first = cached("a", "v0")
    assert first.num_cached_tokens == 0
    again = cached("b", "v0")
    assert again.num_cached_tokens == 28  # 7 full blocks; the last token always runs
    assert again.completions[0].token_ids == first.completions[0].token_ids
    assert cached("c", "v1").num_cached_tokens == 0  # another salt: another namespace


def test_in_flight_weight_update_keeps_requests_running(model, tiny_model_dir, tmp_path):
    other = load_model(tiny_model_dir, seed=2)
    save_model(other, tmp_path / "v1")
    write_marker(tmp_path / "v1")  # FsWeights names a complete (STABLE) directory
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128)
    engine.add_request(GenerateRequest(request_id="r", prompt_ids=[256, 1, 2, 3],
                                       sampling=SamplingParams(temperature=0, max_tokens=12, n=2)))
    for _ in range(5):
        assert engine.step() == []
    engine.load_weights(FsWeights(path=str(tmp_path / "v1")), version=1)
    resp = run_all(engine)["r"]
    for c in resp.completions:
        assert len(c.token_ids) == 12
        assert c.versions == [0] * 5 + [1] * 7  # tokens say which policy sampled them
    # The new weights really are in use: the logprobs of the tokens sampled before the swap
    # are the old model's, those after it are not.
    ids = [256, 1, 2, 3] + resp.completions[0].token_ids
    old_model = load_model(tiny_model_dir, seed=1)  # `model` itself now holds the new weights
    with torch.no_grad():
        old_lp = torch.log_softmax(old_model(torch.tensor([ids]))[0].float(), -1)
    old = [old_lp[3 + j, t].item() for j, t in enumerate(resp.completions[0].token_ids)]
    diffs = [abs(a - b) for a, b in zip(old, resp.completions[0].logprobs)]
    assert max(diffs[:5]) < 1e-4 and min(diffs[5:]) > 1e-3


def test_abort_frees_blocks(model):
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128)
    engine.add_request(GenerateRequest(request_id="r", prompt_ids=[256, 1, 2, 3],
                                       sampling=SamplingParams(max_tokens=50, n=3)))
    engine.step()
    engine.step()
    assert engine.abort("r") and not engine.has_work()
    assert engine.blocks.num_available == engine.blocks.num_blocks


def test_block_manager_lru_and_refcounts():
    bm = BlockManager(num_blocks=3, block_size=2)
    hashes = bm.block_hashes([1, 2, 3, 4, 5], "s")
    assert len(hashes) == 2 and bm.block_hashes([1, 2, 3, 4], "t")[0] != hashes[0]
    a, b = bm.allocate(), bm.allocate()
    bm.register(a, hashes[0])
    bm.register(b, hashes[1])
    bm.release([a, b])  # both cached, evictable
    assert bm.num_available == 3
    assert bm.match_prefix(hashes) == [a, b] and bm.num_available == 1
    bm.release([a, b])
    c, d = bm.allocate(), bm.allocate()  # the free block first, then the LRU cached one (a)
    assert c not in (a, b) and d == a
    assert bm.match_prefix(hashes) == []  # a's content is gone, so the chain breaks at once


@pytest.mark.parametrize("kwargs", [{"block_size": 4}, {"kv_cache_memory_mb": 0.02, "block_size": 4}])
def test_moe_routes_are_recorded_for_every_token(tmp_path, kwargs):
    import json

    from rlcli.ops.attention import ForwardContext, PackedCausalAttention, RoutingContext

    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64,
           "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
           "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    moe = load_model(tmp_path, seed=3)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)  # spread the router so ties cannot hide a wrong route
    engine = NativeEngine(moe, eos_token_ids=[], max_model_len=64, **kwargs)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]]
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, sampling=SamplingParams(
            max_tokens=9, n=2, return_routing=True, seed=i)))
    out = run_all(engine)
    # The same prompts again: served from the prefix cache, whose blocks kept their routes.
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"again{i}", prompt_ids=p, sampling=SamplingParams(
            max_tokens=9, n=2, return_routing=True, seed=i)))
    out.update(run_all(engine))
    if "kv_cache_memory_mb" not in kwargs:
        assert out["again0"].num_cached_tokens > 0 and out["again1"].num_cached_tokens > 0
    for i, p in enumerate(prompts):
        for c in out[str(i)].completions + out[f"again{i}"].completions:
            ids = p + c.token_ids
            routes = c.routed_experts.numpy()
            assert routes.shape == (len(ids) - 1, 2, 2)  # 2 MoE layers (layer 1 is dense), top-2
            pos = torch.arange(len(ids))[None]
            ctx = ForwardContext(attn=PackedCausalAttention(pos), routing=RoutingContext(record=True))
            with torch.no_grad():
                moe(torch.tensor([ids]), pos, ctx)
            ref = ctx.routing.stacked()[:-1].numpy()
            assert (routes.astype("int64") == ref).all()
    if "kv_cache_memory_mb" in kwargs:
        assert engine.stats()["num_preemptions"] > 0  # routes survive recompute after preemption


def test_a_route_log_keeps_every_row_in_order():
    """RouteLog (a sequence's R3 routes): rows appended a chunk at a time, across buffer growth, read
    back in order from any range, including ranges across the rows a fork shares with its prompt."""
    import numpy as np

    from rlcli.infer.sequence import RouteLog

    rows = np.random.default_rng(0).integers(0, 8, size=(300, 3, 2)).astype(np.int16)
    prompt = RouteLog()
    prompt.append(rows[:37])
    prompt.append(rows[37:40])
    shared = prompt.freeze()
    assert len(prompt) == 40 and np.array_equal(shared, rows[:40]) and prompt.freeze() is shared
    child = RouteLog(shared)
    for a in range(40, 300, 7):  # one decode row at a time, or a few: the buffer grows past 64 rows
        child.append(rows[a:min(a + 7, 300)])
    assert len(child) == 300
    for a, b in [(0, 300), (0, 16), (32, 48), (40, 41), (299, 300), (100, 228)]:
        got = child.rows(a, b)
        assert np.array_equal(got, rows[a:b])
        got[:] = -1  # a copy: the log is unchanged
    assert np.array_equal(child.rows(0, 300), rows) and np.array_equal(shared, rows[:40])


@torch.no_grad()
def full_logprobs(model, ids, num_prompt):
    """Log-probabilities of ids[num_prompt:] under one full forward of ``model``."""
    lp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
    return [lp[num_prompt - 1 + j, t].item() for j, t in enumerate(ids[num_prompt:])]


def test_prefix_cache_is_keyed_by_the_weights_that_computed_it(model, tiny_model_dir, tmp_path):
    """KV from other weights is never reused: not by requests queued across a swap, nor by
    those that arrive after it still carrying the old salt (before the orchestrator hears
    of the new version)."""
    new_model = load_model(tiny_model_dir, seed=2)
    save_model(new_model, tmp_path / "v1")
    write_marker(tmp_path / "v1")
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, block_size=4)
    prompt = [256] + list(range(1, 30))

    def add(rid):
        engine.add_request(GenerateRequest(request_id=rid, prompt_ids=prompt, cache_salt="v0",
                                           sampling=SamplingParams(temperature=0, max_tokens=3)))

    add("before")
    assert run_all(engine)["before"].num_cached_tokens == 0
    add("queued")  # waits across the swap
    engine.load_weights(FsWeights(path=str(tmp_path / "v1")), version=1)
    add("window")  # the swap window: new weights, old salt
    out = run_all(engine)
    for rid in ("queued", "window"):
        c = out[rid].completions[0]
        assert out[rid].num_cached_tokens == 0, rid
        assert c.versions == [1, 1, 1]
        ref = full_logprobs(new_model, prompt + c.token_ids, len(prompt))
        assert max(abs(a - b) for a, b in zip(ref, c.logprobs)) < 1e-4
    add("after")  # same salt, same weights: the blocks computed under v1 are shared
    assert run_all(engine)["after"].num_cached_tokens == 28


def test_a_block_computed_across_a_swap_is_never_reused(model, tiny_model_dir, tmp_path):
    """A block whose tokens were computed partly under old and partly under new weights
    belongs to neither version."""
    save_model(load_model(tiny_model_dir, seed=2), tmp_path / "v1")
    write_marker(tmp_path / "v1")
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, block_size=4)
    engine.add_request(GenerateRequest(request_id="a", prompt_ids=[256, 1], cache_salt="s",
                                       sampling=SamplingParams(temperature=0, max_tokens=8)))
    engine.step()  # prefill positions 0-1 under v0
    engine.step()  # position 2 under v0
    engine.load_weights(FsWeights(path=str(tmp_path / "v1")), version=1)
    gen = run_all(engine)["a"].completions[0].token_ids  # position 3 (closing block 0) under v1
    prompt = [256, 1] + gen[:7]  # covers block 0 (mixed) and block 1 (v1 only, behind it)
    for rid in ("b", "c"):
        engine.add_request(GenerateRequest(request_id=rid, prompt_ids=prompt, cache_salt="s",
                                           sampling=SamplingParams(temperature=0, max_tokens=2)))
        engine.step() if rid == "b" else None
    out = run_all(engine)
    assert out["b"].num_cached_tokens == 0
    assert out["c"].num_cached_tokens == 8  # b's blocks, computed under v1 alone


@pytest.mark.parametrize("kwargs", [{"block_size": 4}, {"max_num_batched_tokens": 8, "block_size": 4}])
def test_prompt_logprobs_equal_a_full_forward_also_past_cached_blocks(model, kwargs):
    """sampling.prompt_logprobs = k scores prompt_ids[k:] (a teacher scoring a completion), chunked
    prefill or not; a second request with the same prompt takes the cached blocks before k and scores
    the same; a request without it is not slowed by it."""
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, **kwargs)
    prompt = [256] + list(range(30, 60))
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt]))[0].float() / 0.7, -1)
    expected = [float(ref[p - 1, prompt[p]]) for p in range(12, len(prompt))]
    for i in range(2):
        engine.add_request(GenerateRequest(request_id=f"s{i}", prompt_ids=prompt, sampling=SamplingParams(
            temperature=0.7, max_tokens=1, prompt_logprobs=12)))
        engine.add_request(GenerateRequest(request_id=f"g{i}", prompt_ids=prompt, sampling=SamplingParams(
            temperature=0.7, max_tokens=2)))
        out = run_all(engine)
        assert out[f"s{i}"].prompt_logprobs == pytest.approx(expected, abs=1e-4)
        assert out[f"g{i}"].prompt_logprobs == [] and len(out[f"g{i}"].completions[0].token_ids) == 2
    assert out["s1"].num_cached_tokens == 8  # the blocks before position 11, no further
    with pytest.raises(ValueError, match="must be below the prompt's 31 tokens"):
        engine.add_request(GenerateRequest(request_id="x", prompt_ids=prompt,
                                           sampling=SamplingParams(prompt_logprobs=31)))
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 1"):
        SamplingParams(prompt_logprobs=0)


def test_a_prompt_preempted_mid_prefill_is_scored_once(model):
    """The scored prompt's prefill chunks run again after a preemption: its logprobs are not appended twice."""
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, max_num_batched_tokens=8, block_size=4)
    prompt = [256] + list(range(40, 70))
    engine.add_request(GenerateRequest(request_id="s", prompt_ids=prompt, sampling=SamplingParams(
        max_tokens=1, prompt_logprobs=3)))
    engine.step(), engine.step()  # 16 of 31 tokens computed: tokens 3..16 scored
    [seq] = engine.running
    assert len(seq.req.prompt_logprobs) == 14
    engine._preempt(seq)
    [resp] = run_all(engine).values()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), -1)
    assert resp.prompt_logprobs == pytest.approx([float(ref[p - 1, prompt[p]]) for p in range(3, 31)], abs=1e-4)
