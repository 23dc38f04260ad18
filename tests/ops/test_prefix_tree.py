"""Prefix-tree (shared-prompt) rows: the layout, and the attention backends against the dense mask."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rlcli.ops.document_attention import PackedCausalAttention
from rlcli.ops.prefix_tree import RowTree, dense_mask, plan_row, shared_length

# Two groups sharing 4 and 2 tokens, a lone sample, and a group of one (nothing shared).
UNITS = [(4, [7, 9, 5]), (0, [6]), (2, [3, 8]), (3, [5])]


def _tree_and_positions():
    pieces, tree = plan_row(UNITS)
    pos = np.concatenate([np.arange(s, e) for _, s, e in pieces])
    return tree, torch.from_numpy(pos)[None]


def test_plan_row_layout():
    pieces, tree = plan_row(UNITS)
    assert pieces[:4] == [(0, 0, 4), (0, 4, 7), (1, 4, 9), (2, 4, 5)]
    assert tree.parents == [-1, 0, 0, 0, -1, -1, 5, 5, -1]
    assert tree.num_tokens == sum(shared_length(n, lens) for n, lens in UNITS) == (4 + 3 + 5 + 1) + 6 + (2 + 1 + 6) + 5
    assert tree.num_unshared_tokens() == sum(sum(lens) for _, lens in UNITS)
    assert tree.leaves() == [1, 2, 3, 4, 6, 7, 8]
    # A child sees its prompt and itself, never a sibling or another group.
    m = dense_mask(tree)
    first, second = tree.spans[1], tree.spans[2]
    assert m[second[0], :4].all() and not m[second[0], first[0]:first[1]].any()
    assert not m[tree.spans[4][0], :tree.spans[4][0]].any()
    # The same from per-token segment ids.
    again = RowTree.from_segments(tree.segment_ids(), tree.parents)
    assert again.spans == tree.spans and (again.reach() == tree.reach()).all()


def test_layouts_that_are_not_preorder_are_refused():
    with pytest.raises(ValueError, match="pre-order"):
        RowTree([(0, 2), (2, 4), (4, 6), (6, 8)], [-1, 0, -1, 1])  # segment 3's parent is closed
    with pytest.raises(ValueError, match="contiguous"):
        RowTree([(0, 2), (3, 4)], [-1, -1])
    with pytest.raises(ValueError, match="segment ids"):
        RowTree.from_segments([0, 0, 2], [-1, -1, -1])


def _dense(q, k, v, mask_TS, scale):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask_TS[None, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("cp", [False, True])
def test_tree_attention_matches_dense_mask(backend, cp):
    tree, pos = _tree_and_positions()
    T = tree.num_tokens
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, T, 4, 8, generator=g), torch.randn(1, T, 2, 8, generator=g), \
        torch.randn(1, T, 2, 8, generator=g)
    index = torch.cat([torch.arange(5, 19), torch.arange(30, T)]) if cp else None  # cuts through a prompt
    mask = torch.from_numpy(dense_mask(tree))
    attn = PackedCausalAttention(pos, backend=backend, query_index_T=index, trees=[tree])
    qs = q if index is None else q[:, index]
    with torch.set_grad_enabled(backend == "sdpa"):  # CPU FlexAttention has no backward
        q_, k_, v_ = (x.clone().requires_grad_(backend == "sdpa") for x in (qs, k, v))
        out = attn(0, q_, k_, v_, 0.3)
        ref_q, ref_k, ref_v = (x.clone().requires_grad_(backend == "sdpa") for x in (qs, k, v))
        ref = _dense(ref_q, ref_k, ref_v, mask if index is None else mask[index], 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if backend == "sdpa":  # the prompt's keys collect every child's gradient
        w = torch.randn_like(out)
        (out * w).sum().backward()
        (ref * w).sum().backward()
        for a, b in ((q_, ref_q), (k_, ref_k), (v_, ref_v)):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def _flash_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """flash-attn's varlen semantics (the contract of torch's varlen_attn on CUDA): sequence i
    is queries cu_q[i]:cu_q[i+1] over keys cu_k[i]:cu_k[i+1], causal aligned to the bottom right."""
    assert window_size == (-1, 0) and enable_gqa
    out = []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        t, n = qi.shape[0], ki.shape[0]
        assert t <= max_q and n <= max_k
        mask = torch.ones(t, n, dtype=torch.bool).tril(diagonal=n - t)
        out.append(F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1),
                                                  attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1))
    return torch.cat(out)


def test_varlen_shared_rows_gather_each_segments_keys(monkeypatch):
    """The varlen path's plumbing (per-segment key gather, cu_seqlens over two rows) against
    the dense tree mask, values and gradients; the kernel is flash's contract, emulated."""
    import rlcli.ops.document_attention as da

    monkeypatch.setattr(da, "_varlen_attn", lambda: _flash_varlen_reference)
    da._varlen_params.cache_clear()
    try:
        tree, pos = _tree_and_positions()
        T = tree.num_tokens
        g = torch.Generator().manual_seed(1)
        q, k, v = torch.randn(2, T, 4, 8, generator=g), torch.randn(2, T, 2, 8, generator=g), \
            torch.randn(2, T, 2, 8, generator=g)
        attn = PackedCausalAttention(pos.expand(2, T), backend="varlen", trees=[tree, tree])
        q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
        out = attn._varlen(q_, k_, v_, 0.3)
        mask = torch.from_numpy(dense_mask(tree))
        ref_q, ref_k, ref_v = (x.clone().requires_grad_() for x in (q, k, v))
        ref = _dense(ref_q, ref_k, ref_v, mask, 0.3)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        w = torch.randn_like(out)
        (out * w).sum().backward()
        (ref * w).sum().backward()
        for a, b in ((q_, ref_q), (k_, ref_k), (v_, ref_v)):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    finally:
        da._varlen_params.cache_clear()




@pytest.mark.parametrize("max_padded_keys", [256, 6])
def test_batched_sdpa_matches_dense_mask_and_per_segment_calls(monkeypatch, max_padded_keys):
    """The CPU path without CP: segments of two rows (a tree, and plain documents) in padded
    buckets; with ``max_padded_keys`` 6 the longer segments take unpadded calls of their own
    (a child's ancestors plus itself, and a plain causal root). Values and gradients against
    the dense mask and against one call per segment."""
    import functools

    import rlcli.ops.document_attention as da
    from rlcli.ops.prefix_tree import attention_buckets

    tree, pos = _tree_and_positions()
    T = tree.num_tokens
    docs = RowTree([(0, 10), (10, 11), (11, T)], [-1, -1, -1])
    buckets, _ = attention_buckets([tree, docs], max_padded_keys)
    long = [b for b in buckets if b.Lk > max_padded_keys]
    assert all(b.n == 1 for b in long) and {b.mask is None for b in long} == ({True, False} if long else set())
    assert len(long) == (5 if max_padded_keys == 6 else 0)
    assert len(buckets) < len(tree.spans) + len(docs.spans)
    monkeypatch.setattr(da, "attention_buckets", functools.partial(attention_buckets, max_padded_keys=max_padded_keys))
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, T, 4, 8, generator=g), torch.randn(2, T, 2, 8, generator=g), \
        torch.randn(2, T, 2, 8, generator=g)
    pos2 = torch.cat([pos, torch.from_numpy(np.concatenate([np.arange(e - s) for s, e in docs.spans]))[None]])
    attn = PackedCausalAttention(pos2, backend="sdpa", trees=[tree, docs])
    masks = torch.stack([torch.from_numpy(dense_mask(t)) for t in (tree, docs)])[:, None]
    grads = []
    for run in (lambda *x: attn(0, *x, 0.3), lambda *x: attn._sdpa_per_document(*x, 0.3),
                lambda *x: F.scaled_dot_product_attention(*(y.transpose(1, 2) for y in x), attn_mask=masks,
                                                          scale=0.3, enable_gqa=True).transpose(1, 2)):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = run(*xs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([out.detach()] + [x.grad for x in xs])
    for got in grads[:2]:
        for a, b in zip(got, grads[2]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_fp32_rows_take_the_batched_calls_on_every_device(monkeypatch, backend, device):
    """Flash is half precision only, so fp32 rows under ``varlen`` (CUDA's default for shared
    rows) and ``sdpa`` on any device run the few batched SDPA calls, never one call per segment:
    per segment, the demo's 500 completions a step cost seconds of kernel launches on a GPU."""
    import rlcli.ops.document_attention as da

    tree, pos = _tree_and_positions()
    T = tree.num_tokens
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, T, h, 8, generator=g).to(device) for h in (4, 2, 2))
    attn = PackedCausalAttention(pos, backend=backend, trees=[tree], device=device)
    ref = attn._sdpa_per_document(q, k, v, 0.3)
    monkeypatch.setattr(PackedCausalAttention, "_sdpa_per_document",
                        lambda *a: pytest.fail("fp32 rows took one SDPA call per segment"))
    monkeypatch.setattr(PackedCausalAttention, "_varlen", lambda *a: pytest.fail("fp32 rows reached flash"))
    torch.testing.assert_close(attn(0, q, k, v, 0.3), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("masked", [False, True])
def test_fp32_grouped_heads_run_a_fused_kernel_on_cuda(masked):
    """fp32 attention with grouped K/V heads on CUDA runs the memory-efficient kernel (only it is
    allowed here: the math fallback would raise), values and gradients equal to the math path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rlcli.ops.document_attention import _sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(3, h, 24, 16, generator=g, device="cuda") for h in (4, 2, 2))
    mask = torch.rand(3, 1, 24, 24, generator=g, device="cuda") < 0.7 if masked else None
    if masked:
        mask[..., 0] = True  # every query sees a key
    runs = []
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        with sdpa_kernel(backend):
            out = _sdpa(*xs, 0.25, mask=mask, is_causal=not masked)
        out.square().sum().backward()
        runs.append([out.detach()] + [x.grad for x in xs])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_row_gather_backward_sums_every_copy_without_index_add():
    """The shared-prompt key gather: forward is index_select; backward gives each source row the
    sum of its copies' gradients (copy counts 1, 3 and 8 mixed, one row never read)."""
    from rlcli.ops.document_attention import _GatherPlan, _GatherRows

    g = torch.Generator().manual_seed(0)
    index = np.concatenate([np.repeat(np.arange(0, 4), 8), np.arange(4, 9), np.repeat(np.arange(10, 12), 3)])
    index = index[torch.randperm(len(index), generator=g).numpy()]
    plan = _GatherPlan(index, torch.device("cpu"))
    assert sorted(c for c, _, _ in plan.runs) == [1, 3, 8]
    k, v = torch.randn(12, 2, 4, dtype=torch.float64, generator=g), torch.randn(12, 3, dtype=torch.float64, generator=g)
    a = [x.clone().requires_grad_() for x in (k, v)]
    b = [x.clone().requires_grad_() for x in (k, v)]
    got = _GatherRows.apply(plan, *a)
    ref = [x.index_select(0, torch.from_numpy(index)) for x in b]
    assert all(torch.equal(x, y) for x, y in zip(got, ref))
    w = [torch.randn(x.shape, dtype=torch.float64, generator=g) for x in ref]
    sum((x * y).sum() for x, y in zip(got, w)).backward()
    sum((x * y).sum() for x, y in zip(ref, w)).backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-12, rtol=1e-12)
    assert torch.equal(a[0].grad[9], torch.zeros(2, 4, dtype=torch.float64))
