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
