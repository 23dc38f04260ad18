"""Triton quantization kernels: one pass over memory per quantization, bit-identical to ``quant``.

One kernel, ``_quant_kernel``, covers every quantization the FP8 recipe needs. Each program
loads one tile of ``x`` (``BM`` rows x 128 columns, zero-filled past the edges, as the
reference pads), takes the amax it needs, and writes:

    ROW      1x128 tiles along the last dim  -> q [M, K],   s [M, K/128]     (forward, dgrad)
    COL      1x128 tiles along the rows      -> qt [K, M],  st [K, M/128]    (x^T, dy^T for wgrad:
             written transposed from the same tile, so no transpose copy exists)
             (the tile is stored through transposed addresses; Triton's coalescing pass routes it
             through shared memory so that the writes run along M)
    BLOCK2D  one 128x128 block               -> q [N, K] and optionally qt [K, N], s [N/128, K/128]

ROW and COL together read ``x`` once and write both quantizations (activations in training).
Scales are written through strides, so the 1x128 scales come out column-major (stride
``(1, M)``), the layout ``scaled_mm``'s ``BlockWise1x128`` and DeepGEMM's TMA loads want.

Bit-exactness with the torch reference (``quant.py``): the per-block divisions are ``div_rn``
(IEEE round-to-nearest, as torch divides), elements are multiplied by ``r``, UE8M0 rounds the scale up by bit arithmetic (as the
reference does), and the fp32 -> e4m3 rounding is done by hand (round-to-nearest-even on
the bit pattern for normals, a magic-number add for subnormals) before a cast that is then
exact. The hand rounding is there because Triton's interpreter (``TRITON_INTERPRET=1``,
used by the CPU tests) mis-rounds casts that carry into the next binade; compiled for the
GPU the kernel uses the hardware ``cvt.rn.satfinite`` cast instead (the same values, with
some 15 integer ops per element fewer; ``bench/fp8_quant.py`` checks bit-exactness there).

Triton is optional: ``available()`` is False when it does not import, and callers fall back
to the torch reference.
"""

import logging
import os

import torch

from rlcli.ops.fp8.quant import BLOCK, FP8_DTYPE, ceil_div

log = logging.getLogger("rlcli.fp8")

try:
    import triton
    import triton.language as tl
except (ImportError, OSError) as e:  # CPU CI: no triton
    triton = tl = None
    log.debug("triton does not import: %s", e)


# Under the interpreter the rounding is done by hand (see the module note); compiled, by the hardware cast.
_HW_CAST = os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _scale(amax, UE8M0: tl.constexpr):
        amax = tl.maximum(amax, 1e-12)
        s = tl.math.div_rn(amax, 448.0)
        if UE8M0:  # round up to a power of two: add a mantissa's worth, keep the exponent
            bits = s.to(tl.int32, bitcast=True)
            s = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
            r = tl.math.div_rn(1.0, s)
        else:
            r = tl.math.div_rn(448.0, amax)
        return s, r

    @triton.jit
    def _to_e4m3(x, r, HW_CAST: tl.constexpr):
        y = x * r
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if not HW_CAST:  # round by hand; the cast below is then exact (HW_CAST: the GPU's cvt.rn.satfinite)
            bits = y.to(tl.int32, bitcast=True)
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
            mag = (tl.abs(y) + 24576.0) - 24576.0  # multiples of 2^-9 (ulp of 1.5 * 2^14), ties to even
            sub = (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # keep -0
            y = tl.where(tl.abs(y) >= 0.015625, normal, sub)
        return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")

    @triton.jit
    def _quant_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, map_ptr, M, MO, K,
                      sxb, sxm, sxk, sqb, sqm, ssb, ssm, ssk, sqtb, sqtk, sstb, sstk, sstm,
                      BM: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, BLOCK2D: tl.constexpr,
                      UE8M0: tl.constexpr, MAPPED: tl.constexpr, HW_CAST: tl.constexpr):
        pid_m, pid_k, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b = b.to(tl.int64)  # offsets in int64: tensors past 2^31 elements
        rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        rk = (pid_k * 128 + tl.arange(0, 128)).to(tl.int64)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + b * sxb + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        q_ptrs = q_ptr + b * sqb + rm[:, None] * sqm + rk[None, :]
        # element (m, k) of the tile goes to qt[k, m]: Triton's coalescing lays the store out along m
        qt_ptrs = qt_ptr + b * sqtb + rk[None, :] * sqtk + rm[:, None]
        if BLOCK2D:
            s, r = _scale(tl.max(tl.max(ax, 1), 0), UE8M0)
            q = _to_e4m3(x, r, HW_CAST)
            tl.store(q_ptrs, q, mask=mask)
            tl.store(s_ptr + b * ssb + pid_m * ssm + pid_k * ssk, s)
            if COL:
                tl.store(qt_ptrs, q, mask=mask)
        else:
            if ROW:
                s, r = _scale(tl.max(ax, 1), UE8M0)
                rq = rm
                if MAPPED:  # row m of x goes to row map[m] of q and s (a padded grouped layout)
                    rq = tl.load(map_ptr + rm, mask=rm < M, other=0)
                    q_ptrs = q_ptr + b * sqb + rq[:, None] * sqm + rk[None, :]
                # rows M..MO (zero rows appended, ROW unmapped only): q 0 with the floor's scale
                tl.store(q_ptrs, _to_e4m3(x, r[:, None], HW_CAST), mask=(rm[:, None] < MO) & (rk[None, :] < K))
                tl.store(s_ptr + b * ssb + rq * ssm + pid_k * ssk, s, mask=rm < MO)
            if COL:
                st, rt = _scale(tl.max(ax, 0), UE8M0)
                tl.store(qt_ptrs, _to_e4m3(x, rt[None, :], HW_CAST), mask=mask)
                tl.store(st_ptr + b * sstb + rk * sstk + pid_m * sstm, st, mask=rk < K)


LAUNCH = {"rows": (16, 2), "cols": (128, 4), "both": (128, 4), "weight": (128, 8)}
"""(rows of x per program, warps per program) of each quantization: ``rows`` 1x128 tiles along K,
``cols`` along the tokens (x^T), ``both`` from one read, ``weight`` 128x128 blocks. Only ``rows`` may
take other row counts: a program of the others spans one 128-row tile. The fastest of
``bench/fp8_quant.py --sweep`` on one H200 (docs/benchmarks.md, seventeenth session): summed over
8192x2048, 8192x8192 and 16384x7168, rows 308.5 us (64 rows x 4 warps: 333.1), cols 394.2 (8
warps: 438.9), both 513.8 (8 warps: 582.2); for the weight 4 and 8 warps were within 1%."""


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])[None] if x.dim() != 3 else x


_DUMMY: dict[torch.device, torch.Tensor] = {}


def _dummy(dev: torch.device) -> torch.Tensor:
    """A 1-element tensor for unused pointer arguments (not 0-size: its pointer may be null); one per device."""
    t = _DUMMY.get(dev)
    if t is None:
        t = _DUMMY[dev] = torch.empty(1, device=dev)
    return t


def quantize_act(x: torch.Tensor, ue8m0: bool = False, rows: bool = True, cols: bool = False,
                 row_map: torch.Tensor | None = None, rows_out: int = 0):
    """1x128 quantization of ``x [M, K]`` along K (``rows``) and/or of ``x^T`` along M (``cols``), one pass.

    Returns ``(q [M, K], s [M, K/128] column-major)`` and/or ``(qt [K, M], st [K, M/128]
    column-major)``: the values of ``quant.quantize_1x128(x)`` and ``quant.quantize_1x128(x.t())``.
    With ``row_map`` (int64 [M], rows only) row m is written to row ``row_map[m]`` of ``q [rows_out, K]``
    and ``s [rows_out, K/128]`` (column-major); rows no one maps to are left unwritten. Without it,
    ``rows_out > M`` (rows only) appends zero rows: ``quant.quantize_1x128`` of ``x`` padded with
    ``rows_out - M`` rows of zeros, in the same pass."""
    assert x.dim() == 2 and (rows or cols) and (row_map is None or (rows and not cols))
    assert rows_out <= x.shape[0] or row_map is not None or not cols, "zero rows are appended to rows only"
    M, K = x.shape
    dev = x.device
    Kb = ceil_div(K, BLOCK)
    q = s = qt = st = dummy = _dummy(dev)
    R = rows_out if row_map is not None else max(M, rows_out)
    MO = R if row_map is None and rows else M
    if rows:
        q = torch.empty(R, K, dtype=FP8_DTYPE, device=dev)
        s = torch.empty_strided((R, Kb), (1, R), device=dev)
    if cols:
        qt = torch.empty(K, M, dtype=FP8_DTYPE, device=dev)
        st = torch.empty_strided((K, ceil_div(M, BLOCK)), (1, K), device=dev)
    BM, warps = LAUNCH["both" if rows and cols else "rows" if rows else "cols"]
    grid = (ceil_div(MO, BM), Kb, 1)
    if MO and K:
        _quant_kernel[grid](x, q, s, qt, st, dummy if row_map is None else row_map, M, MO, K,
                            0, x.stride(0), x.stride(1), 0, K, 0, 1 if rows else 0, R if rows else 0,
                            0, M, 0, 1 if cols else 0, K if cols else 0,
                            BM=BM, ROW=rows, COL=cols, BLOCK2D=False, UE8M0=ue8m0, MAPPED=row_map is not None,
                            HW_CAST=_HW_CAST, num_warps=warps)
    if rows and cols:
        return (q, s), (qt, st)
    return (q, s) if rows else (qt, st)


def quantize_weight(w: torch.Tensor, ue8m0: bool = False, transposed: bool = False):
    """128x128 quantization of ``w [..., N, K]`` (2-D or stacked 3-D): ``(q, s)`` as
    ``quant.quantize_128x128``, plus ``(qt [..., K, N], st [..., K/128, N/128])`` when ``transposed``."""
    assert w.dim() in (2, 3)
    w3 = w if w.dim() == 3 else w[None]
    E, N, K = w3.shape
    dev = w.device
    Nb, Kb = ceil_div(N, BLOCK), ceil_div(K, BLOCK)
    q = torch.empty(E, N, K, dtype=FP8_DTYPE, device=dev)
    s = torch.empty(E, Nb, Kb, device=dev)
    qt = torch.empty(E, K, N, dtype=FP8_DTYPE, device=dev) if transposed else _dummy(dev)
    if E and N and K:
        _quant_kernel[(Nb, Kb, E)](w3, q, s, qt, s, s, N, N, K, *w3.stride(), N * K, K, *s.stride(), K * N, N, 0, 0, 0,
                                   BM=128, ROW=False, COL=transposed, BLOCK2D=True, UE8M0=ue8m0, MAPPED=False,
                                   HW_CAST=_HW_CAST, num_warps=LAUNCH["weight"][1])
    squeeze = (lambda t: t[0]) if w.dim() == 2 else (lambda t: t)
    out = (squeeze(q), squeeze(s))
    if transposed:
        return out, (squeeze(qt), squeeze(s.transpose(-1, -2).contiguous()))
    return out
