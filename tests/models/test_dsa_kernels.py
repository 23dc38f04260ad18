"""DSA kernels: the top-k rule against its int64-key reference and its tie-break, and the
Triton kernels (run by Triton's CPU interpreter) against the torch reference path."""

import pytest
import torch

import interpreter
from rlcli.ops import mla

INF = float("inf")


def test_topk_rule_matches_the_int64_key_reference():
    """Many exact ties, -inf (masked) and -0.0 scores, every k from 1 to the row width."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        T, W = int(torch.randint(1, 12, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
        s = torch.randint(-3, 4, (T, W), generator=gen).float()
        s[torch.rand(T, W, generator=gen) < 0.2] = -INF
        s[torch.rand(T, W, generator=gen) < 0.1] = -0.0
        for k in range(1, W + 1):
            new = mla._topk_earliest(s, k).sort(-1).values
            assert torch.equal(new, mla._topk_earliest_int64(s, k).sort(-1).values), (s, k)


@pytest.mark.parametrize("rule", [mla._topk_earliest, mla._topk_earliest_int64])
def test_topk_ties_at_the_cut_go_to_the_earliest_token(rule):
    s = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [-INF, 3.0, -INF, -INF, 3.0], [0.0, -0.0, 5.0, 0.0, -0.0]])
    assert rule(s, 2).sort(-1).values.tolist() == [[1, 2], [1, 4], [0, 2]]
    assert rule(s, 3).sort(-1).values.tolist() == [[1, 2, 3], [0, 1, 4], [0, 1, 2]]


@pytest.mark.skipif(interpreter.ACTIVE, reason="the child process itself")
def test_triton_kernels_under_the_interpreter():
    """The tests below that take ``triton_kernels``, in a child process under Triton's interpreter
    (tests/interpreter.py: it must be on before triton is first imported)."""
    interpreter.run_child_or_skip(__file__)


@pytest.fixture
def triton_kernels(monkeypatch):
    """rlcli.ops.dsa_triton on CPU tensors under Triton's interpreter, and mla switched to it; only
    in the child process of test_triton_kernels_under_the_interpreter."""
    if not interpreter.ACTIVE:
        pytest.skip("run under Triton's interpreter by test_triton_kernels_under_the_interpreter")
    pytest.importorskip("triton")
    from rlcli.ops import dsa_triton
    assert dsa_triton.available(torch.zeros(1))
    monkeypatch.setattr(mla, "TRITON", True)
    return dsa_triton


def test_fused_index_scores_equal_the_torch_scores(triton_kernels):
    """Head dim 24 (padded to 32 in the kernel); shared keys, per-query keys, and the selection
    select_topk makes from the fused scores is the rule applied to them."""
    gen = torch.Generator().manual_seed(1)
    T, Hi, D = 21, 3, 24
    q, w, k = torch.randn(T, Hi, D, generator=gen), torch.randn(T, Hi, generator=gen), torch.randn(T, D, generator=gen)
    mla.TRITON = False
    ref = mla.index_scores(q, w, k, 0.3)
    mla.TRITON = True
    fused = mla.index_scores(q, w, k, 0.3)
    assert torch.allclose(fused, ref, rtol=1e-5, atol=1e-5)
    per_query = mla.index_scores(q[:5], w[:5], k[None].expand(5, -1, -1), 0.3)
    assert torch.allclose(per_query, fused[:5], rtol=1e-5, atol=1e-5)
    t = torch.arange(T)
    idx, valid = mla.select_topk(q, w, k, torch.zeros_like(t), t, 6, 0.3)
    scores = triton_kernels.index_scores(q, w, k, 0.3).masked_fill(t[None] > t[:, None], -INF)
    expect = mla._topk_earliest(scores, 6)
    assert torch.equal(idx.masked_fill(~valid, -1).sort(-1).values,
                       expect.masked_fill(scores.gather(1, expect) == -INF, -1).sort(-1).values)


def test_triton_sparse_attention_equals_the_gathered_reference(triton_kernels):
    """Outputs and gradients at fp32 tolerance: 5 heads (a padded head block), latent 16 and rope
    8 (padded), invalid entries pointing anywhere (token 0 and others), a row with one valid key."""
    gen = torch.Generator().manual_seed(2)
    T, S, H, R, dr, K = 13, 17, 5, 16, 8, 7
    q = torch.randn(T, H, R + dr, generator=gen, requires_grad=True)
    kv = torch.randn(S, R + dr, generator=gen, requires_grad=True)
    idx = torch.stack([torch.randperm(S, generator=gen)[:K] for _ in range(T)])
    valid = torch.rand(T, K, generator=gen) > 0.3
    valid[:, 0] = True
    valid[3, 1:] = False
    idx[5, ~valid[5]] = 0
    g = torch.randn(T, H, R, generator=gen)
    outs = []
    for f in (mla.sparse_latent_attention, triton_kernels.sparse_attention):
        out = f(q, kv, idx, valid, R, 0.2)
        out.backward(g)
        outs.append((out.detach(), q.grad, kv.grad))
        q.grad = kv.grad = None
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()


def test_model_on_triton_kernels_equals_the_torch_path(triton_kernels, hf_model_dir):
    """GLM-5-shaped tiny model, two packed documents, sequence longer than index_topk: loss and
    every gradient through fused scores + Triton attention equal the torch path."""
    from zoo import max_abs_diff, random_ids

    from rlcli.models import load_model
    path, _ = hf_model_dir("glm_moe_dsa")
    ids = random_ids(97, 1, 26, seed=9)
    positions = torch.cat([torch.arange(15), torch.arange(11)])[None]

    def run(triton: bool):
        mla.TRITON = triton
        model = load_model(path)
        logits = model(ids, positions)
        logits.logsumexp(-1).mean().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (a, ga), (b, gb) = run(False), run(True)
    assert max_abs_diff(a, b) <= 1e-5
    assert ga.keys() == gb.keys()
    assert max(max_abs_diff(ga[n], gb[n]) for n in ga) <= 1e-5


def test_topk_rows_is_the_rule_over_each_rows_context(triton_kernels):
    """dsa_triton.topk_rows (the engine's decode choice, one program per row) lists what
    _topk_earliest lists over each row's first lens[t] scores: many exact ties, -0.0 against +0.0,
    negative and huge scores, contexts shorter than, equal to and longer than k, rows longer than
    one chunk; what lies past a row's length (here larger than any score) is never read."""
    gen = torch.Generator().manual_seed(3)
    triton_kernels.TOPK_CHUNK, chunk = 16, triton_kernels.TOPK_CHUNK  # several chunks per row
    try:
        for trial in range(30):
            T, W = int(torch.randint(1, 7, (1,), generator=gen)), int(torch.randint(8, 70, (1,), generator=gen))
            k = int(torch.randint(1, 9, (1,), generator=gen))
            s = torch.randint(-3, 4, (T, W), generator=gen).float() * (1e30 if trial % 3 == 0 else 1.0)
            s[torch.rand(T, W, generator=gen) < 0.15] = -0.0
            s[torch.rand(T, W, generator=gen) < 0.1] = torch.randn(1, generator=gen).item()
            lens = torch.randint(1, W + 1, (T,), generator=gen, dtype=torch.int32)
            lens[0] = min(k, W)
            past = torch.arange(W)[None] >= lens[:, None]
            s[past] = 3e38  # past the context: must not be chosen, nor counted
            got = triton_kernels.topk_rows(s, lens, k)
            for t in range(T):
                n = int(lens[t])
                want = torch.arange(k) if n <= k else mla._topk_earliest(s[t:t + 1, :n], k)[0]
                assert torch.equal(got[t], want), (trial, t, n, k, s[t, :n], got[t])
    finally:
        triton_kernels.TOPK_CHUNK = chunk


def test_paged_selection_equals_the_gathered_one(triton_kernels):
    """The engine's decode selection, keys read in place from a paged index cache by block table
    (shuffled blocks, block size 4, contexts shorter and longer than topk, a one-token context):
    the same chosen positions as select_topk over each sequence's gathered keys, and invalid entries
    (contexts shorter than topk) at position 0."""
    gen = torch.Generator().manual_seed(4)
    Hi, D, bs, topk, num_blocks = 3, 24, 4, 6, 40
    lens = [1, 5, 6, 23, 37]
    cache = torch.randn(num_blocks * bs, D, generator=gen)
    cache[::7] = cache[1]  # exact ties between keys
    owned = torch.randperm(num_blocks, generator=gen).tolist()
    W = -(-max(lens) // bs)
    tables = torch.full((len(lens), W), -1, dtype=torch.long)
    for i, n in enumerate(lens):
        tables[i, :-(-n // bs)] = torch.tensor([owned.pop() for _ in range(-(-n // bs))])
    q, w = torch.randn(len(lens), Hi, D, generator=gen), torch.randn(len(lens), Hi, generator=gen)
    idx, valid = mla.paged_select_topk(q, w, cache, tables, torch.tensor(lens, dtype=torch.int32), bs, topk, 0.3)
    assert idx.shape == valid.shape == (len(lens), topk)
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        keys = cache[tables[i, pos // bs] * bs + pos % bs]
        want, want_valid = mla.select_topk(q[i:i + 1], w[i:i + 1], keys, torch.zeros(1, dtype=torch.long),
                                           torch.tensor([n - 1]), topk, 0.3)
        assert idx[i][valid[i]].tolist() == want[0][want_valid[0]].tolist()
        assert valid[i].sum() == min(n, topk) and (idx[i][~valid[i]] == 0).all()


def test_engine_dsa_decodes_through_the_paged_kernels(triton_kernels, hf_model_dir):
    """The native engine's DSA decodes on the paged path (scores by block table, positions to cache
    slots, sparse attention by slot): greedy completions of prompts longer than index_topk equal
    the model's full forward on the same (Triton) kernels, with the shared-selection layers of GLM-5."""
    from zoo import random_ids

    from rlcli.infer.engine import NativeEngine
    from rlcli.models import load_model
    from rlcli.protocol import GenerateRequest, SamplingParams

    for arch in ("deepseek_v32", "glm_moe_dsa"):
        model = load_model(hf_model_dir(arch)[0]).eval()
        calls = []
        real = mla.paged_select_topk
        mla.paged_select_topk = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, block_size=4, paged_decode=True)
            prompt = random_ids(model.args.vocab_size, 1, model.args.index_topk + 9, seed=5)[0].tolist()
            engine.add_request(GenerateRequest(request_id="r", prompt_ids=prompt,
                                               sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
            out = []
            while engine.has_work():
                out += engine.step()
        finally:
            mla.paged_select_topk = real
        assert calls, "the decodes did not take the paged path"
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert out[-1].completions[0].token_ids == ids[len(prompt):], arch


def test_sparse_attention_stops_at_the_counts(triton_kernels):
    """With valid entries first (the engine's decodes), a query's forward that stops at its count
    equals the one that walks every entry, bit for bit; 40 entries (two blocks of 32), counts 0..40."""
    gen = torch.Generator().manual_seed(6)
    T, S, H, R, dr, K = 6, 50, 4, 16, 8, 40
    q, kv = torch.randn(T, H, R + dr, generator=gen), torch.randn(S, R + dr, generator=gen)
    counts = torch.tensor([1, 5, 31, 32, 33, 40], dtype=torch.int32)
    idx = torch.stack([torch.randperm(S, generator=gen)[:K].sort().values for _ in range(T)])
    valid = torch.arange(K)[None] < counts[:, None]
    idx = idx.masked_fill(~valid, 0)
    full = triton_kernels.sparse_attention(q, kv, idx, valid, R, 0.2)
    assert torch.equal(triton_kernels.sparse_attention(q, kv, idx, valid, R, 0.2, counts), full)
    ref = mla.sparse_latent_attention(q, kv, idx, valid, R, 0.2)
    assert torch.allclose(full, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts Triton's compiled kernels (CUDA)")
@torch.no_grad()
def test_prompts_of_any_length_compile_no_more_dsa_kernels(hf_model_dir):
    """The engine's DSA kernels take the number of chosen tokens and the scores' width as unspecialized
    runtime arguments: after a first request (the warm-up compiles the decodes' kernels, the first
    prefill the prefill's), prompts shorter and longer than index_topk, decoded eagerly and in graphs,
    compile none of them again."""
    from rlcli.infer.engine import NativeEngine
    from rlcli.models import load_model
    from rlcli.ops import dsa_triton_kernels as K
    from rlcli.protocol import GenerateRequest, SamplingParams

    kernels = (K._index_scores_kernel, K._paged_index_scores_kernel, K._sparse_fwd_kernel)

    def variants():
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]

    model = load_model(hf_model_dir("deepseek_v32")[0]).to("cuda", torch.bfloat16).eval()
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=256, block_size=16, max_num_seqs=8)

    def run(lengths):
        for i, n in enumerate(lengths):
            engine.add_request(GenerateRequest(request_id=f"{n}-{i}", prompt_ids=[(3 * i + j) % 90 for j in range(n)],
                                               sampling=SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)))
        while engine.has_work():
            engine.step()

    run([3])
    first = variants()
    assert all(first)
    run([5, 7, 12, 19, 33, 64, 100, 2])
    assert variants() == first
    engine.close()
