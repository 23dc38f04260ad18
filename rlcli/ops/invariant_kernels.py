"""Triton kernels for batch-invariant numerics on CUDA (:mod:`rlcli.ops.batch_invariant`).

Each kernel computes an output element from that element's own inputs in an order fixed by
compile-time constants alone: one launch configuration for every call (block sizes, warps,
stages), no split of a reduction across programs, and the integer arguments that differ
between the engine's calls and the trainer's (row counts; in the reductions also strides)
left unspecialized (``do_not_specialize``), so that Triton compiles the same code whether a
call holds 1 row or 10,000. (A reduction's order follows its data layout, which Triton picks
from what it knows of the strides; a ``tl.dot``'s does not.) Triton specializes
pointers on 16-byte alignment, so the wrappers give the kernels 16-byte aligned tensors
(``_aligned``). What the cuBLAS, cuDNN and flash kernels these replace do instead: pick a
tile shape and split-K by the problem's size, so a row's bits change with its batch.

* ``mm``: ``a @ b^T`` (``b`` in a linear's ``[N, K]`` layout), fp32 accumulation in
  ``BK``-wide steps from k = 0, ``tl.dot`` on ``BM x BN`` tiles fixed per operand dtype; fp32
  operands multiply in IEEE fp32 (no TF32). Only the row count is left unspecialized here.
* ``fp8_mm``: the FP8 recipe's forward GEMM, ``a`` in 1x128 tiles and ``b`` in 128x128
  blocks: per 128-wide K block an FP8 ``tl.dot`` times ``sa[m, kb] * sb[nb, kb]`` added to
  the fp32 accumulator, K blocks in order.
* ``grouped_mm`` / ``fp8_grouped_mm``: MoE experts, tokens sorted by expert with the int32
  cumulative row ends on the device. A program owns a ``BM``-row tile and computes it once per
  expert whose rows it holds, with the other rows masked to zeros: each row gets ``mm``'s /
  ``fp8_mm``'s order on its own expert's weight, however the tokens fell into experts and tiles.
* ``attention``: varlen, keys addressed through a row index (so the engine reads its paged
  cache and the trainer its packed rows in place). One program per (sequence, query head,
  ``BQ`` queries) walks the keys in blocks of ``BLOCK`` positions from 0, flash style: per block
  the scores ``q @ k^T`` as one ``tl.dot``, the running max, ``exp``, the denominators and
  ``p @ v`` (p in the values' dtype, fp32 operands in IEEE fp32), the running sums rescaled
  per query. A query's row of each ``tl.dot`` and each row reduction follows the one compiled
  code whatever the other rows of its tile hold, and a block past a query's keys changes
  nothing of it (max unchanged, rescale by exactly 1, exact zeros added), so a query gets the
  same bits in a ``[T, T]`` causal forward, in a prefill chunk after cached keys and in a
  decode step (a tile with one live query). ``BQ`` = ``BLOCK`` is fixed by the dtype and the
  head dim (:func:`attention_tile`).
* ``rms_norm``: one program per row, the whole row's sum of squares in one ``tl.sum``.
* ``row_sum``: one program per row, ``BLOCK``-wide partial sums over the row in order,
  then one ``tl.sum``.
* ``row_cumsum``: one program per row, a ``tl.cumsum`` per ``BLOCK``-wide block in order, each
  block starting from the last sum of the one before (top-p's nucleus).

Under ``TRITON_INTERPRET=1`` they run on CPU tensors (the tests); the interpreter's
``tl.dot`` is numpy's matmul, so there only the values are checked, the bits on the GPU.
"""

import os

import torch

import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def _jit(no_spec: list[str]):
    """``triton.jit`` with ``no_spec`` left unspecialized (the interpreter, which compiles nothing,
    mishandles that option: there plain ``triton.jit``)."""
    return triton.jit if _INTERPRET else triton.jit(do_not_specialize=no_spec)

# Launch configuration of mm per operand dtype: BM, BN, BK, warps, stages (IEEE fp32 products
# run on the CUDA cores: smaller tiles).
MM_CONFIG = {torch.float32: (64, 64, 32, 4, 2), torch.bfloat16: (128, 128, 64, 8, 3),
             torch.float16: (128, 128, 64, 8, 3)}
FP8_BM = 128  # rows per fp8_mm program (columns and K: 128, the weight blocks)
ROW_BLOCK = 1024  # row_sum's partial-sum width
NUM_WARPS = 4


def attention_tile(dtype: torch.dtype, bd: int) -> int:
    """Queries per attention program, and keys per block: a function of the dtype and the padded
    head dim alone (both sides of a model share them, so both run one compiled kernel). 64 for
    16-bit heads up to 256 wide, fewer for wider ones (absorbed MLA's 576: 16) so that a q and a
    k tile fit in 64 KiB of shared memory; at most 32 for fp32 (IEEE products on the CUDA cores)."""
    rows = 64 if dtype.itemsize < 4 else 32
    while rows > 16 and rows * bd * dtype.itemsize > 32 * 1024:
        rows //= 2
    return rows


# GEMMs leave only the row count unspecialized: a linear's other sizes and strides are the same on
# both sides, and specialized (16-divisible) strides give vectorized loads; the products do not
# depend on how the tiles were loaded.
_NO_SPEC_MM = ["M"]


@triton.jit
def _mm_tile(A, B, rm, rows_ok, rn, N, K, s_am, s_ak, s_bn, s_bk,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """The fp32 ``[BM, BN]`` tile of ``a[rm] @ b[rn]^T`` (rows not ``rows_ok`` read as zeros), K in order."""
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(A + rm[:, None] * s_am + kk[None, :] * s_ak, mask=rows_ok[:, None] & (kk[None, :] < K), other=0.0)
        b = tl.load(B + rn[None, :] * s_bn + kk[:, None] * s_bk, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        elif UPCAST:  # the interpreter's half-precision tl.dot is wrong; values only there
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _fp8_tile(A, SA, B, SB, rm, rows_ok, rn, pid_n, N, K, s_am, s_sam, s_sak, s_bn, s_sbn, s_sbk, BM: tl.constexpr):
    """The fp32 ``[BM, 128]`` tile of the FP8 recipe's product: per 128-wide K block, in order, an
    FP8 ``tl.dot`` times ``sa[m, kb] * sb[nb, kb]``."""
    rk = tl.arange(0, 128)
    acc = tl.zeros([BM, 128], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, 128)):
        kk = kb * 128 + rk
        a = tl.load(A + rm[:, None] * s_am + kk[None, :], mask=rows_ok[:, None] & (kk[None, :] < K), other=0.0)
        b = tl.load(B + rn[None, :] * s_bn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        sa = tl.load(SA + rm * s_sam + kb * s_sak, mask=rows_ok, other=0.0)
        sb = tl.load(SB + pid_n * s_sbn + kb * s_sbk)
        acc += tl.dot(a, b) * (sa[:, None] * sb)
    return acc


@_jit(_NO_SPEC_MM)
def _mm_kernel(A, B, C, M, N, K, s_am, s_ak, s_bn, s_bk, s_cm,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
               UPCAST: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = _mm_tile(A, B, rm, rm < M, rn, N, K, s_am, s_ak, s_bn, s_bk, BM, BN, BK, IEEE, UPCAST)
    tl.store(C + rm[:, None] * s_cm + rn[None, :], acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


_NO_SPEC_FP8 = ["M"]


@_jit(_NO_SPEC_FP8)
def _fp8_mm_kernel(A, SA, B, SB, C, M, N, K, s_am, s_sam, s_sak, s_bn, s_sbn, s_sbk, s_cm, BM: tl.constexpr):
    pid_n = tl.program_id(1)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = pid_n * 128 + tl.arange(0, 128)
    acc = _fp8_tile(A, SA, B, SB, rm, rm < M, rn, pid_n, N, K, s_am, s_sam, s_sak, s_bn, s_sbn, s_sbk, BM)
    tl.store(C + rm[:, None] * s_cm + rn[None, :], acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _first_group(OFFS, m0, G, GP: tl.constexpr):
    """(g, start): the first group whose rows reach past row ``m0`` (``OFFS`` holds the groups' int32
    cumulative row ends), and the row it starts at."""
    idx = tl.arange(0, GP)
    ends = tl.load(OFFS + idx, mask=idx < G, other=2147483647)
    before = ends <= m0
    return tl.sum(before.to(tl.int32), axis=0), tl.max(tl.where(before, ends, 0), axis=0)


_NO_SPEC_GROUPED = ["R"]


@_jit(_NO_SPEC_GROUPED)
def _grouped_mm_kernel(A, B, C, OFFS, R, N, K, G, s_am, s_ak, s_bg, s_bn, s_bk, s_cm,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GP: tl.constexpr,
                       IEEE: tl.constexpr, UPCAST: tl.constexpr):
    m0 = tl.program_id(0) * BM
    rm = m0 + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    g, start = _first_group(OFFS, m0, G, GP)
    while (g < G) & (start < m0 + BM):  # each group with rows in this tile: its rows alone, its weight
        end = tl.load(OFFS + g)
        if end > start:
            rows_ok = (rm >= start) & (rm < end)
            acc = _mm_tile(A, B + g.to(tl.int64) * s_bg, rm, rows_ok, rn, N, K, s_am, s_ak, s_bn, s_bk,
                           BM, BN, BK, IEEE, UPCAST)
            tl.store(C + rm[:, None] * s_cm + rn[None, :], acc.to(C.dtype.element_ty),
                     mask=rows_ok[:, None] & (rn[None, :] < N))
        start = end
        g += 1


@_jit(_NO_SPEC_GROUPED)
def _fp8_grouped_mm_kernel(A, SA, B, SB, C, OFFS, R, N, K, G, s_am, s_sam, s_sak, s_bg, s_bn, s_sbg, s_sbn,
                           s_sbk, s_cm, BM: tl.constexpr, GP: tl.constexpr):
    pid_n = tl.program_id(1)
    m0 = tl.program_id(0) * BM
    rm = m0 + tl.arange(0, BM)
    rn = pid_n * 128 + tl.arange(0, 128)
    g, start = _first_group(OFFS, m0, G, GP)
    while (g < G) & (start < m0 + BM):
        end = tl.load(OFFS + g)
        if end > start:
            rows_ok = (rm >= start) & (rm < end)
            g64 = g.to(tl.int64)
            acc = _fp8_tile(A, SA, B + g64 * s_bg, SB + g64 * s_sbg, rm, rows_ok, rn, pid_n, N, K, s_am, s_sam,
                            s_sak, s_bn, s_sbn, s_sbk, BM)
            tl.store(C + rm[:, None] * s_cm + rn[None, :], acc.to(C.dtype.element_ty),
                     mask=rows_ok[:, None] & (rn[None, :] < N))
        start = end
        g += 1


_NO_SPEC_ATTN = ["HQ", "G", "D", "DV", "s_qn", "s_qh", "s_kr", "s_kh", "s_vr", "s_vh", "s_on", "s_oh"]


@_jit(_NO_SPEC_ATTN)
def _attention_kernel(Q, K, V, O, KIDX, CU_Q, CU_K, scale, HQ, G, D, DV, s_qn, s_qh, s_kr, s_kh, s_vr, s_vh,
                      s_on, s_oh, BD: tl.constexpr, BDV: tl.constexpr, BQ: tl.constexpr, BLOCK: tl.constexpr,
                      IEEE: tl.constexpr, UPCAST: tl.constexpr):
    ih = tl.program_id(0)
    i = ih // HQ
    h = ih % HQ
    hk = h // G
    q0 = tl.load(CU_Q + i)
    num_q = tl.load(CU_Q + i + 1) - q0
    k0 = tl.load(CU_K + i)
    t = tl.program_id(1) * BQ + tl.arange(0, BQ)
    q_ok = t < num_q
    # The keys each query sees: the first n of its sequence's (bottom-right causal); none past its queries.
    n = tl.where(q_ok, tl.load(CU_K + i + 1) - k0 - num_q + t + 1, 0)
    n_tile = tl.max(n, axis=0)
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    q = tl.load(Q + (q0 + t)[:, None] * s_qn + h * s_qh + d[None, :], mask=q_ok[:, None] & (d[None, :] < D),
                other=0.0)
    m = tl.full([BQ], float("-inf"), tl.float32)
    den = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, BDV], dtype=tl.float32)
    for j in range(0, tl.cdiv(n_tile, BLOCK)):
        pos = j * BLOCK + tl.arange(0, BLOCK)
        in_tile = pos < n_tile
        rows = tl.load(KIDX + k0 + pos, mask=in_tile, other=0).to(tl.int64)
        k = tl.load(K + rows[:, None] * s_kr + hk * s_kh + d[None, :], mask=in_tile[:, None] & (d[None, :] < D),
                    other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        elif UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(pos[None, :] < n[:, None], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query with no key yet (padding rows)
        alpha = tl.exp(m - m_use)
        p = tl.exp(s - m_use[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v = tl.load(V + rows[:, None] * s_vr + hk * s_vh + dv[None, :], mask=in_tile[:, None] & (dv[None, :] < DV),
                    other=0.0)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        elif UPCAST:
            pv = tl.dot(p, v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
    tl.store(O + (q0 + t)[:, None] * s_on + h * s_oh + dv[None, :], out.to(O.dtype.element_ty),
             mask=q_ok[:, None] & (dv[None, :] < DV))


@_jit(["N", "s_x", "s_y"])
def _rms_norm_kernel(X, W, Y, N, s_x, s_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * s_x + cols, mask=cols < N, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * r).to(Y.dtype.element_ty)  # cast back, then the weight: the model's RMSNorm order
    w = tl.load(W + cols, mask=cols < N, other=0.0)
    tl.store(Y + row * s_y + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty), mask=cols < N)


@_jit(["N", "s_x"])
def _row_sum_kernel(X, OUT, N, s_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        acc += tl.load(X + row * s_x + c0 + cols, mask=c0 + cols < N, other=0.0).to(tl.float32)
    tl.store(OUT + row, tl.sum(acc, axis=0))


@_jit(["N", "s_x", "s_y"])
def _row_cumsum_kernel(X, Y, N, s_x, s_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    carry = tl.zeros([], dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        x = tl.load(X + row * s_x + c0 + cols, mask=c0 + cols < N, other=0.0).to(tl.float32)
        c = tl.cumsum(x, axis=0) + carry
        tl.store(Y + row * s_y + c0 + cols, c, mask=c0 + cols < N)
        carry = tl.sum(tl.where(cols == BLOCK - 1, c, 0.0), axis=0)


# ------------------------------------------------------------------------------ wrappers


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a 16-byte aligned data pointer (a copy only when it is not)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    return _aligned(t if t.stride(-1) == 1 else t.contiguous())


def mm(a_MK: torch.Tensor, b_NK: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a @ b^T`` ``[M, N]`` in ``out_dtype`` (default ``a``'s); ``a`` and ``b`` of one dtype."""
    a_MK, b_NK = _aligned(a_MK), _aligned(b_NK)
    M, K = a_MK.shape
    N = b_NK.shape[0]
    c = torch.empty(M, N, device=a_MK.device, dtype=out_dtype or a_MK.dtype)
    if M == 0 or N == 0:
        return c
    BM, BN, BK, warps, stages = MM_CONFIG[a_MK.dtype]
    _mm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        a_MK, b_NK, c, M, N, K, a_MK.stride(0), a_MK.stride(1), b_NK.stride(0), b_NK.stride(1), c.stride(0),
        BM=BM, BN=BN, BK=BK, IEEE=a_MK.dtype == torch.float32, UPCAST=_INTERPRET, num_warps=warps, num_stages=stages)
    return c


def fp8_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 recipe's ``gemm`` (:mod:`rlcli.ops.fp8.backends`): ``a [M, K]`` with 1x128 scales
    ``sa [M, K/128]`` (any strides), ``b [N, K]`` with 128x128 scales ``sb [N/128, K/128]``."""
    a, b = _inner_contiguous(a), _inner_contiguous(b)
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty(M, N, device=a.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return c
    sa, sb = _aligned(sa.float()), _aligned(sb.float())
    _fp8_mm_kernel[(triton.cdiv(M, FP8_BM), triton.cdiv(N, 128))](
        a, sa, b, sb, c, M, N, K, a.stride(0), sa.stride(0), sa.stride(1), b.stride(0), sb.stride(0), sb.stride(1),
        c.stride(0), BM=FP8_BM, num_warps=8, num_stages=3)
    return c


def grouped_mm(x_RK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[g-1]:offs[g]`` of ``x`` times ``w[g]^T`` for every group (MoE experts), ``[R, N]``
    in ``x``'s dtype, one launch, no host sync (:func:`rlcli.ops.grouped_gemm.grouped_mm`'s contract;
    rows past the last offset are zeros). A tile of rows that spans several groups is computed once
    per group, each time with only that group's rows, so a row's bits are :func:`mm`'s order of
    its own row and weight, whichever rows share its group or tile."""
    x, w = _aligned(x_RK), _inner_contiguous(w_GNK)
    R, K = x.shape
    G, N = w.shape[0], w.shape[1]
    c = torch.zeros(R, N, device=x.device, dtype=x.dtype)
    if R == 0 or N == 0 or G == 0:
        return c
    offs = _aligned(offs_G.to(device=x.device, dtype=torch.int32).contiguous())
    BM, BN, BK, warps, stages = MM_CONFIG[x.dtype]
    _grouped_mm_kernel[(triton.cdiv(R, BM), triton.cdiv(N, BN))](
        x, w, c, offs, R, N, K, G, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0),
        BM=BM, BN=BN, BK=BK, GP=max(16, triton.next_power_of_2(G)), IEEE=x.dtype == torch.float32, UPCAST=_INTERPRET,
        num_warps=warps, num_stages=stages)
    return c


def fp8_grouped_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 recipe's ``grouped_gemm`` (:mod:`rlcli.ops.fp8.backends`): rows ``offs[g-1]:offs[g]``
    of ``a [R, K]`` (1x128 scales ``sa [R, K/128]``, any strides) times ``b[g]^T`` (``b [G, N, K]``,
    128x128 scales ``sb [G, N/128, K/128]``); rows past the last offset are zeros. As
    :func:`grouped_mm`: one launch, each group's rows alone, :func:`fp8_mm`'s order per row."""
    a, b = _inner_contiguous(a), _inner_contiguous(b)
    R, K = a.shape
    G, N = b.shape[0], b.shape[1]
    c = torch.zeros(R, N, device=a.device, dtype=out_dtype)
    if R == 0 or N == 0 or G == 0:
        return c
    sa, sb = _aligned(sa.float()), _aligned(sb.float())
    offs = _aligned(offs.to(device=a.device, dtype=torch.int32).contiguous())
    _fp8_grouped_mm_kernel[(triton.cdiv(R, FP8_BM), triton.cdiv(N, 128))](
        a, sa, b, sb, c, offs, R, N, K, G, a.stride(0), sa.stride(0), sa.stride(1), b.stride(0), b.stride(1),
        sb.stride(0), sb.stride(1), sb.stride(2), c.stride(0), BM=FP8_BM, GP=max(16, triton.next_power_of_2(G)),
        num_warps=8, num_stages=3)
    return c


def attention(q_NHD: torch.Tensor, k_RHD: torch.Tensor, v_RHD: torch.Tensor, key_rows: torch.Tensor,
              cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, scale: float) -> torch.Tensor:
    """Causal attention of sequences flattened along dim 0, forward only, ``[N, Hq, Dv]``.

    Sequence ``i`` has queries ``cu_q[i]:cu_q[i+1]`` of ``q`` and keys
    ``k[key_rows[cu_k[i]:cu_k[i+1]]]`` (and ``v`` alike), in position order; its queries are the
    last of them (bottom-right causal: query ``t`` sees its sequence's first ``nk - nq + t + 1``
    keys). ``key_rows`` lets keys stay where they are (a paged cache, a packed row). GQA: query
    head ``h`` reads key head ``h // (Hq / Hkv)``. Every caller runs this one compiled kernel
    (one tile configuration per dtype and head width), so a query's bits depend only on its own q, keys and
    values, not on the other queries of its call."""
    q, k, v = (_inner_contiguous(t) for t in (q_NHD, k_RHD, v_RHD))
    Hq, D = q.shape[1], q.shape[2]
    Hkv, Dv = k.shape[1], v.shape[-1]
    out = torch.empty(q.shape[0], Hq, Dv, device=q.device, dtype=q.dtype)
    num_seqs = cu_q.numel() - 1
    if out.numel() == 0 or num_seqs == 0 or max_q == 0:
        return out
    rows, cu_q, cu_k = (_aligned(x.to(device=q.device, dtype=torch.int64).contiguous()) for x in (key_rows, cu_q, cu_k))
    # One block width for both products: with a value block narrower than the key block (a
    # 24-wide latent key with a 16-wide value, bf16) Triton 3.6's kernel gave wrong outputs on the
    # H200, and the engine step that ran it an illegal memory access (tests/ops/test_invariant_kernels.py).
    BD = BDV = max(16, triton.next_power_of_2(max(D, Dv)))
    tile = attention_tile(q.dtype, BD)
    _attention_kernel[(num_seqs * Hq, triton.cdiv(max_q, tile))](
        q, k, v, out, rows, cu_q, cu_k, float(scale), Hq, Hq // Hkv, D, Dv, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        BD=BD, BDV=BDV, BQ=tile, BLOCK=tile, IEEE=q.dtype == torch.float32, UPCAST=_INTERPRET,
        num_warps=NUM_WARPS, num_stages=1)
    return out


def dense_attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, scale: float,
                    lens_B: torch.Tensor) -> torch.Tensor:
    """:func:`rlcli.ops.batch_invariant.invariant_attention`'s contract (``[B, H, T, D]``, row ``b``
    holding ``lens[b]`` keys), forward only, through :func:`attention`."""
    B, Hq, T, D = q_BHTD.shape
    S = k_BHSD.shape[2]
    dev = q_BHTD.device
    lens = lens_B.to(device=dev, dtype=torch.int64)
    cu_k = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    cu_k[1:] = torch.cumsum(lens, 0)
    total = int(cu_k[-1]) if B else 0
    seq = torch.repeat_interleave(torch.arange(B, device=dev), lens, output_size=total)
    rows = seq * S + torch.arange(total, device=dev) - cu_k[:-1].repeat_interleave(lens, output_size=total)
    cu_q = torch.arange(B + 1, dtype=torch.int64, device=dev) * T
    out = attention(q_BHTD.transpose(1, 2).reshape(B * T, Hq, D), k_BHSD.transpose(1, 2).reshape(B * S, -1, D),
                    v_BHSD.transpose(1, 2).reshape(B * S, k_BHSD.shape[1], -1), rows, cu_q, cu_k, T, scale)
    return out.view(B, T, Hq, -1).transpose(1, 2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim, forward only."""
    x2 = _inner_contiguous(x.reshape(-1, x.shape[-1]))
    N = x2.shape[1]
    y = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, _aligned(weight.contiguous()), y, N, x2.stride(0), y.stride(0),
                                         float(eps), BLOCK=max(16, triton.next_power_of_2(N)), num_warps=NUM_WARPS)
    return y.view(*x.shape[:-1], N)


def row_cumsum(x_MN: torch.Tensor) -> torch.Tensor:
    """fp32 cumulative sum along each row of a 2-D tensor."""
    x = _inner_contiguous(x_MN)
    out = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    if x.numel():
        _row_cumsum_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0), BLOCK=ROW_BLOCK,
                                          num_warps=NUM_WARPS)
    return out


def row_sum(x_MN: torch.Tensor) -> torch.Tensor:
    """fp32 sum of each row of a 2-D tensor."""
    x = _inner_contiguous(x_MN)
    out = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    if x.shape[0]:
        _row_sum_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=ROW_BLOCK, num_warps=NUM_WARPS)
    return out
