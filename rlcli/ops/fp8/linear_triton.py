"""An FP8 linear for a few rows (decode) in Triton: the block-scaled GEMM of rows quantized in 1x128
tiles, by the quantization kernel beforehand or inside the GEMM.

``linear(x, w, ws)`` computes ``Q1x128(x) . w^T`` for ``x [M, K]`` in high precision, ``w [N, K]``
FP8 with 128x128 block scales ``ws [N/128, K/128]`` (an FP8 engine's weights), with fp32
accumulation: what ``quantize_act`` followed by :meth:`GemmBackend.gemm` computes; given ``xs``, ``x``
is ``quantize_act``'s output and the kernel reads it. Through ``scaled_mm`` a decode step's linear
costs four kernels besides the quantization: the rows padded to 128 (cuBLASLt has no algorithm for
ragged M), the scales padded and re-laid out, and the GEMM, whose 128-row tile is mostly padding at
decode batch sizes. Each is a few microseconds on a GPU; in a decode graph
(:mod:`rlcli.infer.cuda_graphs`) those microseconds, times seven linears a layer, are the step.

Each program computes a ``BM x BN`` tile of the output (``BN`` divides 128, so one weight block row
per program) over its share of K (:func:`split_k`: a weight with too few column tiles to fill the
GPU is cut along K too, each split writing an fp32 partial that a second kernel sums in split
order). Along K it takes one 128-wide block at a time: it loads the rows' block of ``x`` (and
without ``xs`` quantizes it as :func:`rlcli.ops.fp8.quant.quantize_1x128` does: the same jitted scale
and cast as :mod:`rlcli.ops.fp8.kernels`, so the FP8 data is bit-identical), and adds
``dot(q, w_blk^T)`` in fp32 times the rows' scales and the block's scale, the order the grouped kernel
(:mod:`.grouped_triton`) and DeepGEMM accumulate in.

The backends (:func:`rlcli.ops.fp8.backends.gemm_x`, made for inference) send a linear here only
where it measured faster than ``scaled_mm`` (:func:`serves`), and with its rows already quantized
(``xs``: the quantization kernel's output, shared by linears reading the same input): on an H100
(``bench/fp8_decode_linear.py``, docs/benchmarks.md, thirty-third session), over Qwen3-0.6B's and
DeepSeek-V3's linears, quantizing inside the GEMM took 0.36-0.85x the time of quantize-then-``scaled_mm``
at 1 and 16 rows, but quantizing first and reading the FP8 rows took less again on DeepSeek-V3's weights
(``q_b_proj`` 10.7 against 15.9 µs, 0.40x ``scaled_mm``'s), within 0.5 µs of it on Qwen3-0.6B's, and
less than ``scaled_mm`` at 64 rows on every shape but DeepSeek-V3's ``o_proj`` (16,384 x 7,168: 1.09x).
Quantizing inside the GEMM redoes it for every column tile; :func:`linear` still does that without
``xs`` (the bench's *fused* arm, and the test of its bits).
"""

import functools

import torch

from rlcli.ops.fp8.quant import BLOCK

try:
    import triton
    import triton.language as tl

    from rlcli.ops.fp8.kernels import _HW_CAST, _scale, _to_e4m3
except (ImportError, OSError):  # CPU CI: no triton
    triton = tl = None

SERVED = ((32, 1 << 62), (64, 1 << 26))
"""The batches the backends send here (:func:`serves`): (most rows, weights of fewer elements)."""


def available() -> bool:
    return triton is not None


def serves(rows: int, k: int, n: int) -> bool:
    """Whether a linear of ``rows`` already quantized rows, ``k`` input and ``n`` output features runs
    faster here than through ``scaled_mm`` (module docstring): up to 32 rows; 64 for a weight of fewer
    than 64M elements."""
    return any(rows <= most and n * k < below for most, below in SERVED)


def block_m(rows: int) -> int:
    """Rows per tile: 16 (``tl.dot``'s least) up to 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def block_n(n: int) -> int:
    """Output columns per program, the fastest of ``bench/fp8_decode_linear.py --sweep`` on an H100 by
    the weight's rows: 16 up to 2,048 (more programs for a small weight), 32 up to 4,096, else 64."""
    return 16 if n <= 2048 else 32 if n <= 4096 else 64


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def split_k(n: int, k: int, bn: int, sms: int) -> int:
    """How many programs share K for an ``[n, k]`` weight at tile width ``bn`` on a GPU of ``sms``
    multiprocessors: column tiles times splits about four per multiprocessor, each split at least
    two 128-wide blocks; 1 where the column tiles alone fill the GPU. The fastest of
    ``bench/fp8_decode_linear.py --sweep`` on an H100 (1 to 16 splits) for DeepSeek-V3's K of 7,168
    and 16,384 was 4 to 16 splits, within 10% of what this picks."""
    tiles, blocks = -(-n // bn), -(-k // BLOCK)
    if tiles >= sms:
        return 1
    return max(1, min(-(-4 * sms // tiles), blocks // 2))


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, KB_PER, stride_xm, stride_xsm, stride_xsk,
                       stride_wn, stride_wsn, stride_os, stride_om, BM: tl.constexpr, BN: tl.constexpr,
                       UE8M0: tl.constexpr, HW_CAST: tl.constexpr, PREQ: tl.constexpr):
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        rmask, cmask = rows < M, cols < N
        ks = tl.arange(0, 128)
        ws_row = ws_ptr + (pid_n * BN // 128) * stride_wsn  # BN divides 128: one block row per program
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        kb0 = pid_k * KB_PER  # this program's share of K: KB_PER 128-wide blocks
        for kb in range(kb0, tl.minimum(kb0 + KB_PER, tl.cdiv(K, 128))):
            kk = kb * 128 + ks
            kmask = kk < K
            if PREQ:  # x is already FP8, its 1x128 scales beside it
                q = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0)
                s = tl.load(xs_ptr + rows * stride_xsm + kb * stride_xsk, mask=rmask, other=0.0)
            else:
                x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0).to(tl.float32)
                s, r = _scale(tl.max(tl.abs(x), 1), UE8M0)
                q = _to_e4m3(x, r[:, None], HW_CAST)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=cmask[:, None] & kmask[None, :],
                        other=0.0)
            acc += tl.dot(q, tl.trans(w)) * s[:, None] * tl.load(ws_row + kb)
        tl.store(out_ptr + pid_k * stride_os + rows[:, None] * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _sum_splits_kernel(part_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < MN
        acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
        for sp in tl.static_range(SPLITS):  # in split order: the sum is the same every call
            acc += tl.load(part_ptr + sp * MN + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, ue8m0: bool, out_dtype: torch.dtype,
           bn: int | None = None, splits: int | None = None, xs: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (any float dtype; tiles of up to 64 rows) quantized in 1x128 tiles, times ``w [N, K]``
    FP8 with 128x128 scales ``ws [ceil(N/128), ceil(K/128)]`` -> ``[M, N]`` in ``out_dtype``
    (module docstring). ``bn`` overrides :func:`block_n` (a divisor of 128, at least 16), ``splits``
    :func:`split_k`: with more than one, each program sums its share of K's blocks into an fp32
    partial, and a second kernel adds the partials in split order. With ``xs`` (its 1x128 scales,
    ``[M, ceil(K/128)]``, any strides), ``x`` is already quantized and is read as it is."""
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K, (x.shape, w.shape)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    ws = ws if ws.stride(1) == 1 else ws.contiguous()
    bm, bn = block_m(M), bn or block_n(N)
    assert BLOCK % bn == 0 and bn >= 16, bn
    blocks = triton.cdiv(K, BLOCK)
    splits = min(max(1, splits or split_k(N, K, bn, _sms(x.device))), blocks)
    per = triton.cdiv(blocks, splits)
    splits = triton.cdiv(blocks, per)  # no split without a block
    dst = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), splits)
    sx = xs if xs is not None else ws  # unread without xs
    _linear_kernel[grid](x, sx, w, ws, dst, M, N, K, per, x.stride(0), sx.stride(0), sx.stride(1), w.stride(0),
                         ws.stride(0), M * N, N, BM=bm, BN=bn, UE8M0=ue8m0, HW_CAST=_HW_CAST, PREQ=xs is not None,
                         num_warps=4, num_stages=4)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](dst, out, M * N, SPLITS=splits, BLOCK_SIZE=1024)
    return out
