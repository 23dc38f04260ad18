"""The engine's paged attention on CUDA in half precision (varlen flash calls: decodes with
grouped heads folded into query rows, prefill chunks causal) equals a dense fp32 reference
per sequence: scattered blocks, grouped and ungrouped heads, a whole prompt, a chunk after
cached KV and decodes of different context lengths, alone and in one step; the decodes also
through the paged decode kernel (``paged_decode``). Needs a GPU (skipped elsewhere)."""

import pytest
import torch
import torch.nn.functional as F

from rlcli.ops.attention import PagedAttention, PagedAttentionMetadata
from rlcli.ops.document_attention import _varlen_attn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or _varlen_attn() is None,
                                reason="needs CUDA and torch.nn.attention.varlen")

BLOCK, NUM_BLOCKS, HQ, HKV, D = 16, 96, 8, 2, 64


def reference(q_THD, k_SHD, v_SHD, scale):
    t, s = q_THD.shape[0], k_SHD.shape[0]
    q, k, v = (x.float().transpose(0, 1)[None] for x in (q_THD, k_SHD, v_SHD))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[0].transpose(0, 1)


# (tokens already cached, new tokens) per sequence; decodes first, as the engine orders a step.
STEPS = {"mixed": [(70, 1), (5, 1), (33, 20), (0, 41)], "decodes": [(70, 1), (5, 1), (300, 1)],
         "prefills": [(33, 20), (0, 41)]}


@pytest.mark.parametrize("paged", [False, True])  # decodes in the varlen call, or the paged decode kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("hq", [HQ, HKV])  # grouped heads (decodes fold them into query rows), and not
def test_varlen_paged_attention_matches_the_dense_reference(dtype, step, hq, paged):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, HKV, D, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, HKV, D, device=dev, dtype=dtype, generator=g)
    seqs = STEPS[step]
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    tables, slots, query_start, lens = [], [], [0], []
    for cached, new in seqs:
        n = cached + new
        table = [perm.pop() for _ in range((n + BLOCK - 1) // BLOCK)]
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, n)]
        query_start.append(query_start[-1] + new)
        lens.append(n)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], device=dev)
    meta = PagedAttentionMetadata(slot_mapping=torch.tensor(slots, device=dev), query_start=query_start,
                                  context_lens=lens, block_tables=block_tables, block_size=BLOCK,
                                  num_decode=sum(1 for _, new in seqs if new == 1))
    N = query_start[-1]
    q = torch.randn(1, N, hq, D, device=dev, dtype=dtype, generator=g)
    k = torch.randn(1, N, HKV, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(1, N, HKV, D, device=dev, dtype=dtype, generator=g)
    attn = PagedAttention([(k_cache, v_cache)], meta, paged_decode=paged)
    assert attn._use_varlen(q[0], k_cache, v_cache)
    out = attn(0, q, k, v, 0.125)[0]
    assert out.shape == (N, hq, D)
    for i, table in enumerate(tables):
        pos = torch.arange(lens[i], device=dev)
        idx = torch.tensor(table, device=dev)[pos // BLOCK] * BLOCK + pos % BLOCK
        k_i, v_i = k_cache.flatten(0, 1)[idx], v_cache.flatten(0, 1)[idx]  # the new keys were written in place
        a, b = query_start[i], query_start[i + 1]
        torch.testing.assert_close(out[a:b].float(), reference(q[0, a:b], k_i, v_i, 0.125), rtol=0, atol=2e-2)


def test_varlen_attention_with_grouped_heads_equals_repeated_heads():
    """Whichever way this torch takes grouped K/V heads (its own argument, the kernel's
    native support, or repeated heads), the result is that of repeated heads."""
    from rlcli.ops.document_attention import varlen_attention

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    q = torch.randn(40, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(90, HKV, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu_q = torch.tensor([0, 1, 2, 40], dtype=torch.int32, device=dev)  # two decodes, then a chunk of 38
    cu_k = torch.tensor([0, 30, 31, 90], dtype=torch.int32, device=dev)
    got = varlen_attention(q, k, v, cu_q, cu_k, 38, 59, 0.125)
    rep = HQ // HKV
    want = varlen_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), cu_q, cu_k, 38, 59, 0.125)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_varlen_attention_gradients_with_grouped_heads_equal_repeated_heads():
    """The trainer's varlen path under autograd: whichever way grouped heads are taken, the
    gradients are those of repeated heads (K/V gradients summed over each group)."""
    from rlcli.ops.document_attention import varlen_attention

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    q0 = torch.randn(40, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    k0, v0 = (torch.randn(40, HKV, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = torch.tensor([0, 13, 40], dtype=torch.int32, device=dev)
    grads = []
    for repeat in (False, True):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        kk, vv = (k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)) if repeat else (k, v)
        varlen_attention(q, kk, vv, cu, cu, 27, 27, 0.125).float().square().sum().backward()
        grads.append([q.grad.float(), k.grad.float(), v.grad.float()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
