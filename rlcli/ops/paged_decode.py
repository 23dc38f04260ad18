"""Decode attention that reads a block-paged KV cache in place (Triton; the native engine on CUDA).

One query token per sequence. A program owns one sequence and one K/V head: the ``G`` query heads
that share that head are the rows of its tiles (padded to 16, ``tl.dot``'s least; at most 64 a
program, fewer for wide heads, so absorbed MLA's many heads split over several programs), so each
key and value is read from the cache once for the whole group. It walks the sequence's positions in tiles
of ``BN``, finds each position's block in the sequence's row of ``block_tables`` and its offset in
it, and keeps flash attention's running max, denominators and weighted sum in fp32. Nothing is
gathered or copied per step: the bucketed SDPA path it replaces on CUDA
(:meth:`rlcli.ops.attention.PagedAttention._decode`) copied every decoding sequence's whole context
out of the cache in every layer, planned buckets on the host and launched ~10 kernels per bucket;
the varlen flash path (half precision) copied it once per layer. fp32 products run in IEEE fp32
(no TF32), so fp32 engines keep the eager path's precision.

The engine takes it with ``infer.engine.paged_decode`` (off by default: so far it has run under
Triton's interpreter only, not compiled on a GPU). Under ``TRITON_INTERPRET=1`` it runs on CPU
tensors (tests/ops/test_paged_decode.py), and with ``RLCLI_PAGED_DECODE_ON_CPU=1`` as well the
paged attention backend takes it on the CPU by default (the zoo's decode tests under the interpreter).
"""

import os

import torch

import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32: fp32 operands in IEEE fp32 (no TF32); under the interpreter,
    which has no bf16 products, upcast; else ``a`` in ``b``'s dtype (the probabilities for ``p @ v``)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    elif UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a.to(b.dtype), b)
    return out


@triton.jit
def _paged_decode_kernel(Q, K, V, O, TABLES, LENS, scale, G, D, DV, BS,
                         s_qs, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_os, s_oh, s_ts,
                         BG: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    hk = tl.program_id(1) // tl.cdiv(G, BG)
    n = tl.load(LENS + seq)
    g = (tl.program_id(1) % tl.cdiv(G, BG)) * BG + tl.arange(0, BG)
    g_ok = g < G
    h = hk * G + g
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    q = tl.load(Q + seq * s_qs + h[:, None] * s_qh + d[None, :], mask=g_ok[:, None] & (d[None, :] < D), other=0.0)
    m = tl.full([BG], float("-inf"), tl.float32)
    den = tl.zeros([BG], dtype=tl.float32)
    acc = tl.zeros([BG, BDV], dtype=tl.float32)
    for j in range(0, tl.cdiv(n, BN)):
        pos = j * BN + tl.arange(0, BN)
        ok = pos < n
        block = tl.load(TABLES + seq * s_ts + pos // BS, mask=ok, other=0).to(tl.int64)
        off = (pos % BS).to(tl.int64)
        k = tl.load(K + block[:, None] * s_kb + off[:, None] * s_kt + hk * s_kh + d[None, :],
                    mask=ok[:, None] & (d[None, :] < D), other=0.0)
        s = tl.where(ok[None, :], _dot(q, tl.trans(k), IEEE, UPCAST) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every sequence has a key in its first tile
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v = tl.load(V + block[:, None] * s_vb + off[:, None] * s_vt + hk * s_vh + dv[None, :],
                    mask=ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p, v, IEEE, UPCAST)
        m = m_new
    out = acc / den[:, None]
    tl.store(O + seq * s_os + h[:, None] * s_oh + dv[None, :], out.to(O.dtype.element_ty),
             mask=g_ok[:, None] & (dv[None, :] < DV))


def paged_decode(q_SHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query per sequence over its cached keys, ``[S, Hq, Dv]``.

    ``k_cache [num_blocks, block_size, Hkv, D]`` and ``v_cache [num_blocks, block_size, Hkv, Dv]``
    (``v_cache`` may be a strided view of ``k_cache``, as MLA's latent); sequence ``i``'s keys are
    its first ``context_lens[i]`` positions (>= 1), position ``p`` in block ``block_tables[i, p //
    block_size]`` at offset ``p % block_size``. Query head ``h`` reads K/V head ``h // (Hq / Hkv)``."""
    S, Hq, D = q_SHD.shape
    bs, Hkv, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    out = torch.empty(S, Hq, Dv, device=q_SHD.device, dtype=q_SHD.dtype)
    if S == 0:
        return out
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode needs the head dim innermost (stride 1) in both caches")
    if q_SHD.stride(-1) != 1:
        q_SHD = q_SHD.contiguous()
    G = Hq // Hkv
    tables = block_tables if block_tables.dtype in (torch.int32, torch.int64) else block_tables.long()
    lens = context_lens.to(device=q_SHD.device, dtype=torch.int32)
    BD = max(16, triton.next_power_of_2(D))
    BDV = max(16, triton.next_power_of_2(Dv))
    BN = 64 if q_SHD.dtype.itemsize < 4 else 32
    while BN > 16 and BN * max(BD, BDV) * q_SHD.dtype.itemsize > 32 * 1024:
        BN //= 2
    BG = max(16, min(triton.next_power_of_2(G), 64))  # query heads per program (absorbed MLA has 16-128)
    while BG > 16 and BG * max(BD, BDV) > 16 * 1024:
        BG //= 2
    _paged_decode_kernel[(S, Hkv * triton.cdiv(G, BG))](
        q_SHD, k_cache, v_cache, out, tables, lens, float(scale), G, D, Dv, bs,
        q_SHD.stride(0), q_SHD.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), tables.stride(0),
        BG=BG, BD=BD, BDV=BDV, BN=BN, IEEE=q_SHD.dtype == torch.float32,
        UPCAST=_INTERPRET, num_warps=4, num_stages=2)
    return out
