"""Document-masked packed attention against the dense [B, T, T] mask it replaces."""

import pytest
import torch
import torch.nn.functional as F

from rlcli.ops.document_attention import PackedCausalAttention, doc_ids_from_positions


def _positions(lengths_per_row: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row])


def _dense_reference(q, k, v, position_ids_BT, scale, query_index=None):
    """The old path: a dense document-causal mask over the full row."""
    doc = doc_ids_from_positions(position_ids_BT)
    T = position_ids_BT.shape[1]
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    if query_index is not None:
        mask = mask[:, query_index]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _qkv(B, T, Tq, hq=4, hkv=2, dqk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Tq, hq, dqk, generator=g), torch.randn(B, T, hkv, dqk, generator=g),
            torch.randn(B, T, hkv, dv, generator=g))


ROWS = [[5, 9, 1, 7], [22]]  # several documents (one of a single token) and a one-document row


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_document_attention_matches_dense_mask(backend):
    pos = _positions(ROWS)
    q, k, v = _qkv(2, 22, 22)
    attn = PackedCausalAttention(pos, backend=backend)
    with torch.set_grad_enabled(backend == "sdpa"):  # CPU FlexAttention has no backward
        ref = _dense_reference(q, k, v, pos, 0.3)
        out = attn(0, q, k, v, 0.3)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_queries_subset_against_full_keys(backend):
    """Context parallelism: a rank's queries are two chunks of the row, its keys the whole row."""
    pos = _positions([[3, 8, 6, 7], [24]])
    query_index = torch.cat([torch.arange(6, 12), torch.arange(18, 24)])
    q_full, k, v = _qkv(2, 24, 24, seed=1)
    q = q_full[:, query_index]
    attn = PackedCausalAttention(pos, backend=backend, query_index_T=query_index)
    with torch.set_grad_enabled(backend == "sdpa"):
        out = attn(0, q, k, v, 0.25)
        ref = _dense_reference(q_full, k, v, pos, 0.25)[:, query_index]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_compiled_flex_raises_where_torch_compile_would_run_it_unfused():
    """Past dynamo's recompile limit a compiled function runs eagerly, and an eager flex_attention
    materializes every score: the CUDA path's compiled FlexAttention raises there instead."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from rlcli.ops.document_attention import _compiled_flex

    pos = _positions(ROWS)
    q, k, v = (t.transpose(1, 2) for t in _qkv(2, 22, 22, hkv=4))
    mask = PackedCausalAttention(pos, backend="flex").block_mask()
    try:
        with torch._dynamo.config.patch(recompile_limit=0), pytest.raises(FailOnRecompileLimitHit):
            _compiled_flex()(q, k, v, block_mask=mask, scale=0.3)
    finally:
        torch._dynamo.reset()  # forget the frame given up on


def test_sdpa_backend_gradients_match_dense_mask():
    pos = _positions(ROWS)
    q, k, v = (t.requires_grad_() for t in _qkv(2, 22, 22, seed=2))
    g = torch.randn(2, 22, 4, 8, generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (lambda: PackedCausalAttention(pos, backend="sdpa")(0, q, k, v, 0.3),
               lambda: _dense_reference(q, k, v, pos, 0.3)):
        (fn() * g).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("expand_kv", [False, True])
def test_cudnn_backend_per_document_matches_dense_mask_with_gradients(expand_kv):
    """The cudnn backend's own slicing (and its K/V head repeat for a cuDNN without GQA) against
    the dense mask; on the CPU SDPA runs its own kernels, so this checks the code around them."""
    pos = _positions(ROWS)
    q, k, v = (t.requires_grad_() for t in _qkv(2, 22, 22, dv=16, seed=4))
    g = torch.randn(2, 22, 4, 16, generator=torch.Generator().manual_seed(5))
    attn = PackedCausalAttention(pos, backend="cudnn")
    attn.expand_kv = expand_kv
    grads = []
    for fn in (lambda: attn(0, q, k, v, 0.3), lambda: _dense_reference(q, k, v, pos, 0.3)):
        out = fn()
        (out * g).sum().backward()
        grads.append([out.detach()] + [t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cudnn_backend_under_context_parallelism_takes_the_sdpa_code():
    pos = _positions([[3, 8, 6, 7], [24]])
    query_index = torch.cat([torch.arange(6, 12), torch.arange(18, 24)])
    q_full, k, v = _qkv(2, 24, 24, seed=1)
    out = PackedCausalAttention(pos, backend="cudnn", query_index_T=query_index)(0, q_full[:, query_index], k, v, 0.25)
    torch.testing.assert_close(out, _dense_reference(q_full, k, v, pos, 0.25)[:, query_index], atol=1e-5, rtol=1e-5)


def test_auto_backend_on_cpu_is_per_document_sdpa():
    assert PackedCausalAttention(_positions(ROWS)).backend == "sdpa"
    with pytest.raises(ValueError, match="varlen"):
        PackedCausalAttention(_positions(ROWS), backend="varlen", query_index_T=torch.arange(3))
