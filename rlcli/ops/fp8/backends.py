"""FP8 block-scaled GEMM backends: DeepGEMM, torch ``scaled_mm``, and a CPU emulation.

Every backend takes operands already quantized by :mod:`rlcli.ops.fp8.quant` (so all
three see bit-identical FP8 data and scales) and computes, with fp32 accumulation:

    gemm(a, sa, b, sb)                a [M, K] 1x128, b [N, K] 128x128      -> a @ b^T  [M, N]
    gemm_1x128(a, sa, b, sb)          a [M, K] 1x128, b [N, K] 1x128        -> a @ b^T  [M, N]  (weight gradients)
    grouped_gemm(a, sa, b, sb, offs)  a [M, K] 1x128 rows sorted by group,  -> [M, N], rows offs[g-1]:offs[g]
                                      b [G, N, K] 128x128, offs [G] int32      use b[g]
                                      cumulative row ends (torch grouped_mm's convention)

and, from high-precision ``x``, ``gemm_x`` and ``grouped_gemm_x``: its 1x128 quantization (shared
with the previous call on the same tensor), then ``gemm`` or ``grouped_gemm``.

``emulated`` dequantizes and multiplies in fp32: the reference, on any device.
``torch`` calls ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` x
``BlockWise128x128`` (cuBLASLt, Hopper): scale_a column-major ``(M, K/128)`` with stride
``(1, M)``, scale_b the ``(N/128, K/128)`` block scales transposed; M in whole 128-row tiles
(``gemm_x`` quantizes the zero rows in; ``gemm`` pads other operands). ``scaled_mm`` has no
grouped form for block scales: the grouped GEMM runs the Triton kernel of :mod:`.grouped_triton`,
which reads the offsets on the device (a loop of ``scaled_mm`` over the groups, one host sync for
the offsets, where triton does not import). Made for inference (FP8 weights), its ``gemm_x`` of a
decode batch (``linear_triton.serves``: up to 32 rows, 64 for most weights) runs
:mod:`.linear_triton` on the quantized rows (two kernels instead of four: no padding), as does
DeepGEMM's made for inference.
``deep_gemm`` calls DeepGEMM's ``fp8_gemm_nt`` and ``m_grouped_fp8_gemm_nt_contiguous``; the
contiguous grouped layout needs every group's rows aligned to 128, which is built on the device
(padding rows marked -1) so it needs no host sync; ``grouped_gemm_x`` quantizes high-precision rows straight into
that padded buffer (the quantizer writes row m to its padded row), the training path. Weight
gradients (1x128 x 1x128) go through ``scaled_mm``'s ``BlockWise1x128`` pair, or, with
deep_gemm, through DeepGEMM's SM90 1D1D kernel if the first weight gradient measured it faster
(both run once on the same operands and must agree). That one measurement decides for every
shape: DeepGEMM compiles a kernel per shape on first use, so timing each new shape (every
linear of a model, each expert group of a per-expert loop) put a JIT compile and host syncs
into the first step once per shape, whichever kernel then won.

A DeepGEMM call with a shape it has not run in this process first says so to the process's
registry entry (:func:`rlcli.transport.registry.expect_long`): on a cold JIT cache that call
compiles a kernel with nvcc (tens of seconds on a busy host), longer than peers wait for a beat.

Kernels want K a multiple of 128: the FP8 data is zero padded along K, which adds zeros
to every dot product (see the quantization note on edge blocks).
"""

import logging
import weakref
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from rlcli.errors import ConfigError
from rlcli.ops.fp8 import grouped_triton, linear_triton, runtime
from rlcli.ops.fp8.quant import BLOCK, FP8_DTYPE, ceil_div, dequantize_1x128, dequantize_128x128
from rlcli.transport.registry import expect_long

log = logging.getLogger("rlcli.fp8")

BackendName = Literal["auto", "deep_gemm", "torch", "emulated"]

JIT_COMPILE_S = 180.0
"""How long a DeepGEMM call on a new shape may take (its JIT compile): what the process promises peers."""


class GemmBackend(Protocol):
    name: str
    grouped_on_device: bool
    """Whether the grouped GEMMs read the group offsets on the device, with no host sync, so a CUDA
    graph can hold them (the native engine's decode graphs of FP8 MoE models)."""

    def gemm(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor: ...

    def gemm_1x128(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor: ...

    def grouped_gemm(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                     offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor: ...

    def grouped_gemm_x(self, x: torch.Tensor, ue8m0: bool, b: torch.Tensor, sb: torch.Tensor,
                       offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor: ...

    def gemm_x(self, x: torch.Tensor, ue8m0: bool, b: torch.Tensor, sb: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor: ...


def group_ranges(offs: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) row range of every group; one host sync."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


class EmulatedBackend:
    """Dequantize, then an fp32 matmul: the reference the kernels are checked against."""

    name = "emulated"
    grouped_on_device = False  # a loop over the groups

    def gemm(self, a, sa, b, sb, out_dtype):
        return (dequantize_1x128(a, sa) @ dequantize_128x128(b, sb).T).to(out_dtype)

    def gemm_1x128(self, a, sa, b, sb, out_dtype):
        return (dequantize_1x128(a, sa) @ dequantize_1x128(b, sb).T).to(out_dtype)

    def grouped_gemm(self, a, sa, b, sb, offs, out_dtype):
        out = a.new_zeros(a.shape[0], b.shape[1], dtype=out_dtype)
        for g, (s, e) in enumerate(group_ranges(offs)):
            if e > s:
                out[s:e] = self.gemm(a[s:e], sa[s:e], b[g], sb[g], out_dtype)
        return out

    def grouped_gemm_x(self, x, ue8m0, b, sb, offs, out_dtype):
        return grouped_gemm_x(self, x, ue8m0, b, sb, offs, out_dtype)

    def gemm_x(self, x, ue8m0, b, sb, out_dtype):
        return gemm_x(self, x, ue8m0, b, sb, out_dtype)


def _pad_k(q: torch.Tensor) -> torch.Tensor:
    """Zero pad FP8 data along its last dim to a multiple of 128 (padding in uint8: fp8 has no pad kernel)."""
    pad = (-q.shape[-1]) % BLOCK
    if not pad:
        return q
    return F.pad(q.view(torch.uint8), (0, pad)).view(FP8_DTYPE)


def _pad_rows(q: torch.Tensor, s: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FP8 data with zero rows appended to a multiple of 128, and its per-row scales (1x128 tiles)
    with rows of 1 (``s`` None: 128x128 blocks, whose scale rows already cover a partial block)."""
    pad = (-q.shape[0]) % BLOCK
    if not pad:
        return q, s
    return (F.pad(q.view(torch.uint8), (0, 0, 0, pad)).view(FP8_DTYPE),
            None if s is None else F.pad(s, (0, 0, 0, pad), value=1.0))


def _col_major(s: torch.Tensor) -> torch.Tensor:
    """``s`` with stride ``(1, rows)``; the quantizers already write that layout (no copy then).
    ``scaled_mm`` checks that stride even for a single K block (K <= 128), where the dim's stride
    is arbitrary: there the same memory gets the stride it wants, copied first where it does not
    start on 16 bytes (an expert's rows sliced out of a larger batch; cuBLASLt refused those)."""
    if s.stride(0) == 1 and s.shape[1] == 1:
        s = s if s.data_ptr() % 16 == 0 else s.clone()
        return s.as_strided(s.shape, (1, s.shape[0]))
    return s if s.stride(0) == 1 and s.stride(1) == s.shape[0] else s.t().contiguous().t()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class TorchScaledMMBackend:
    """``torch.nn.functional.scaled_mm`` with DeepSeek-style block scales (cuBLASLt on SM90)."""

    name = "torch"
    row_align = BLOCK  # cuBLASLt has no algorithm for ragged M: gemm pads the rows to 128 (gemm_x quantizes them so)

    def __init__(self, inference: bool = False) -> None:
        # Grouped GEMMs in rlcli.ops.fp8.grouped_triton (offsets read on the device), else a loop of
        # scaled_mm over the groups (one host sync; each group padded to 128 rows); for inference,
        # decode rows through rlcli.ops.fp8.linear_triton.
        self.grouped_on_device = grouped_triton.available()
        self.fused_rows = inference and linear_triton.available()
        self._fp32_out = True  # cuBLASLt builds without fp32 output for block scaling fall back to bf16
        self._st = getattr(F, "ScalingType", None) if hasattr(F, "scaled_mm") else None

    def _mm(self, a, sa, b, sb, recipe_b, out_dtype):
        a, b = _pad_k(a), _pad_k(b)
        st = self._st
        if st is not None:
            rb = st.BlockWise128x128 if recipe_b == "128x128" else st.BlockWise1x128
            return F.scaled_mm(a, b.t(), sa, st.BlockWise1x128, sb, rb, output_dtype=out_dtype)
        return torch._scaled_mm(a, b.t(), sa, sb, out_dtype=out_dtype)

    def gemm(self, a, sa, b, sb, out_dtype):
        kb = sb.shape[1]
        # cuBLASLt wants the K-block count rounded up to 4 (a copy only where it is not)
        sbp = F.pad(sb, (0, (-kb) % 4), value=1.0) if kb % 4 else sb.contiguous()
        M, N = a.shape[0], b.shape[0]
        # Rows of both to multiples of 128: cuBLASLt found no algorithm for ragged M (expert groups)
        # on the H200, and refused N = 96 (CUBLAS_STATUS_NOT_SUPPORTED; a 96-wide MoE expert).
        a, sa = _pad_rows(a, sa)
        b = _pad_rows(b)[0]
        return self._mm(a, _col_major(sa), b, sbp.t(), "128x128", out_dtype)[:M, :N]

    def gemm_1x128(self, a, sa, b, sb, out_dtype):
        M, N = a.shape[0], b.shape[0]
        (a, sa), (b, sb) = _pad_rows(a, sa), _pad_rows(b, sb)  # as in gemm
        if out_dtype == torch.float32 and self._fp32_out:
            try:
                return self._mm(a, _col_major(sa), b, _col_major(sb), "1x128", out_dtype)[:M, :N]
            except RuntimeError as e:
                log.warning("scaled_mm 1x128 x 1x128 with fp32 output failed (%s); using bf16 output", e)
                self._fp32_out = False
        return _as(self._mm(a, _col_major(sa), b, _col_major(sb), "1x128", torch.bfloat16)[:M, :N], out_dtype)

    def grouped_gemm(self, a, sa, b, sb, offs, out_dtype):
        if self.grouped_on_device and a.is_cuda:
            return grouped_triton.grouped_gemm(a, sa, b, sb, offs, out_dtype)
        out = a.new_zeros(a.shape[0], b.shape[1], dtype=out_dtype)
        for g, (s, e) in enumerate(group_ranges(offs)):
            if e > s:
                out[s:e] = self.gemm(a[s:e], sa[s:e], b[g], sb[g], out_dtype)
        return out

    def grouped_gemm_x(self, x, ue8m0, b, sb, offs, out_dtype):
        return grouped_gemm_x(self, x, ue8m0, b, sb, offs, out_dtype)

    def gemm_x(self, x, ue8m0, b, sb, out_dtype):
        return gemm_x(self, x, ue8m0, b, sb, out_dtype)


class DeepGemmBackend:
    """DeepGEMM's JIT kernels (``fp8_gemm_nt``, ``m_grouped_fp8_gemm_nt_contiguous``).

    Unless ``strict``, a kernel that raises (an unsupported shape, a DeepGEMM build whose
    signature differs) is logged once and that operation falls back to torch ``scaled_mm``.
    """

    name = "deep_gemm"

    def __init__(self, dg, strict: bool = False, inference: bool = False) -> None:
        self.dg, self.strict = dg, strict
        self.torch = TorchScaledMMBackend()
        self.fused_rows = inference and linear_triton.available()
        self.failed: set[str] = set()
        self._last = self._last_x = None
        self.wgrad_kernel: str | None = None  # "deep_gemm" | "torch", measured on the first weight gradient
        self.wgrad_choice: dict[tuple, str] = {}  # (a.shape, b.shape) -> the kernel each wgrad shape ran on
        self.wgrad_ms: dict[tuple, dict[str, float]] = {}  # the shape that was measured -> ms per kernel
        self.shapes_run: set[tuple] = set()  # (op, M, N, K): what may need no JIT compile any more
        self.wgrad_dims_kw = {"compiled_dims": "mn"}  # (_wgrad_1d1d)
        try:
            self.align = int(dg.get_mk_alignment_for_contiguous_layout())
        except AttributeError:
            self.align = BLOCK

    @property
    def grouped_on_device(self) -> bool:
        """The contiguous layout is built on the device; where that kernel failed here, the grouped
        GEMMs fell back to the torch backend's."""
        return "m_grouped_fp8_gemm_nt_contiguous" not in self.failed or self.torch.grouped_on_device

    def _guarded(self, op: str, kernel, fallback):
        if op in self.failed:
            return fallback()
        try:
            return kernel()
        except (RuntimeError, AssertionError, TypeError) as e:
            if self.strict:
                raise
            log.warning("deep_gemm %s failed (%s); using torch scaled_mm for it from now on", op, e)
            self.failed.add(op)
            return fallback()

    def _new_shape(self, op: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Before a DeepGEMM call: the first with these shapes (module docstring) announces a possible compile.
        Keyed by the exact M, which DeepGEMM's kernel choice depends on; a shape that turns out to need no
        compile costs at most one registry write."""
        key = (op, a.shape[0], *b.shape)
        if key not in self.shapes_run:
            self.shapes_run.add(key)
            expect_long(JIT_COMPILE_S)

    def gemm(self, a, sa, b, sb, out_dtype):
        def kernel():
            out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
            self._new_shape("gemm", a, b)
            self.dg.fp8_gemm_nt((_pad_k(a), sa), (_pad_k(b), sb), out)
            return _as(out, out_dtype)
        return self._guarded("fp8_gemm_nt", kernel, lambda: self.torch.gemm(a, sa, b, sb, out_dtype))

    def gemm_1x128(self, a, sa, b, sb, out_dtype):
        """Weight gradients: DeepGEMM's SM90 1D1D kernel (fp32 out) or cuBLASLt's blockwise pair,
        whichever the first weight gradient measured faster (after checking they agree), for
        every shape (module docstring)."""
        key = (tuple(a.shape), tuple(b.shape))
        choice = self.wgrad_kernel
        if "fp8_gemm_nt 1d1d" in self.failed or not a.is_cuda:
            choice = "torch"
        elif choice is None:
            if torch.cuda.is_current_stream_capturing():
                return self.torch.gemm_1x128(a, sa, b, sb, out_dtype)
            choice = self.wgrad_kernel = self._choose_wgrad(a, sa, b, sb, key)
        self.wgrad_choice.setdefault(key, choice)
        if choice == "deep_gemm":
            return self._guarded("fp8_gemm_nt 1d1d", lambda: _as(self._wgrad_1d1d(a, sa, b, sb), out_dtype),
                                 lambda: self.torch.gemm_1x128(a, sa, b, sb, out_dtype))
        return self.torch.gemm_1x128(a, sa, b, sb, out_dtype)

    def _wgrad_1d1d(self, a, sa, b, sb):
        """``a`` [out features, tokens] . ``b`` [in features, tokens]^T. DeepGEMM compiles N and K into a
        kernel unless told otherwise (``compiled_dims="nk"``); here K is the micro-batch's token count,
        new at almost every micro-batch of an RL step, so M and N are compiled and K is a runtime
        argument (a build whose ``fp8_gemm_nt`` lacks the argument compiles per K)."""
        d = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)  # the kernel adds c = d
        self._new_shape("wgrad", a, b)
        args = ((_pad_k(a), sa), (_pad_k(b), sb), d)
        if self.wgrad_dims_kw:
            try:
                self.dg.fp8_gemm_nt(*args, c=d, recipe=(1, 1, 128), **self.wgrad_dims_kw)
                return d
            except TypeError:  # an older signature: nothing ran
                log.info("deep_gemm fp8_gemm_nt takes no compiled_dims: weight gradients compile per token count")
                self.wgrad_dims_kw = {}
        self.dg.fp8_gemm_nt(*args, c=d, recipe=(1, 1, 128))
        return d

    def _choose_wgrad(self, a, sa, b, sb, key) -> str:
        """Run both kernels on these operands (host syncs: the first weight gradient only), keep the faster
        one if they agree to 1e-2 relative; DeepGEMM's is dropped for good when it raises or disagrees."""
        ref = self.torch.gemm_1x128(a, sa, b, sb, torch.float32)
        try:
            out = self._wgrad_1d1d(a, sa, b, sb)
        except (RuntimeError, AssertionError, TypeError) as e:
            log.warning("deep_gemm 1D1D wgrad failed (%s); weight gradients use torch scaled_mm", e)
            self.failed.add("fp8_gemm_nt 1d1d")
            return "torch"
        err = float((out - ref).norm() / ref.norm().clamp(min=1e-30))
        if not err < 1e-2:  # a wrong layout or recipe is O(1) off; bf16 rounding of the reference ~2e-3
            log.warning("deep_gemm 1D1D wgrad disagrees with scaled_mm (rel err %.2e); using scaled_mm", err)
            self.failed.add("fp8_gemm_nt 1d1d")
            return "torch"
        ms = {"deep_gemm": _cuda_ms(lambda: self._wgrad_1d1d(a, sa, b, sb)),
              "torch": _cuda_ms(lambda: self.torch.gemm_1x128(a, sa, b, sb, torch.float32))}
        choice = min(ms, key=ms.get)
        log.info("fp8 wgrad kernel, measured at %s: deep_gemm %.3f ms, scaled_mm %.3f ms -> %s for every shape",
                 key, ms["deep_gemm"], ms["torch"], choice)
        self.wgrad_ms[key] = ms
        return choice

    def grouped_gemm(self, a, sa, b, sb, offs, out_dtype):
        return self._guarded("m_grouped_fp8_gemm_nt_contiguous", lambda: self._grouped(a, sa, b, sb, offs, out_dtype),
                             lambda: self.torch.grouped_gemm(a, sa, b, sb, offs, out_dtype))

    def grouped_gemm_x(self, x, ue8m0, b, sb, offs, out_dtype):
        """Quantizes ``x``'s rows straight into the padded layout (no scatter of the FP8 rows); the
        quantization of the last ``(x, offs)`` is kept for the next projection reading the same ``x``."""
        def kernel():
            M, G = x.shape[0], b.shape[0]
            dst, layout, M_pad = self._layout(offs, M, G)
            aq, sa = self._padded_rows(x, ue8m0, offs, dst, M_pad)
            return self._run_grouped(aq, sa, b, sb, layout, dst, M_pad, out_dtype)
        return self._guarded("m_grouped_fp8_gemm_nt_contiguous", kernel,
                             lambda: grouped_gemm_x(self.torch, x, ue8m0, b, sb, offs, out_dtype))

    def gemm_x(self, x, ue8m0, b, sb, out_dtype):
        return gemm_x(self, x, ue8m0, b, sb, out_dtype)

    def _padded_rows(self, x, ue8m0, offs, dst, M_pad):
        last = self._last_x
        key = (x._version if not x.is_inference() else None, offs._version, ue8m0, tuple(x.shape))
        if last is not None and last[0]() is x and last[1]() is offs and last[2] == key and key[0] is not None:
            return last[3]
        value = runtime.quantize_rows_to(x.reshape(-1, x.shape[-1]), ue8m0, dst, M_pad)
        self._last_x = (weakref.ref(x), weakref.ref(offs), key, value)
        return value

    def _layout(self, offs: torch.Tensor, M: int, G: int):
        """(dst row of every token row, group id of every padded row (-1: padding), padded rows) for
        ``offs``; kept for the last ``offs`` tensor, which an MoE layer's GEMMs and their backward share."""
        key = (M, G, offs._version)
        if self._last is not None and self._last[0]() is offs and self._last[1] == key:
            return self._last[2]
        dev = offs.device
        offs64 = offs.to(dtype=torch.int64)
        counts = torch.diff(offs64, prepend=offs64.new_zeros(1))
        padded = (counts + self.align - 1) // self.align * self.align
        pad_starts = torch.cumsum(padded, 0) - padded
        row = torch.arange(M, device=dev)
        group = torch.searchsorted(offs64, row, right=True)
        dst = row - (offs64 - counts)[group] + pad_starts[group]
        M_pad = padded_rows(M, G, self.align)
        layout = torch.full((M_pad,), -1, dtype=torch.int32, device=dev)
        layout[dst] = group.to(torch.int32)
        value = (dst, layout, M_pad)
        self._last = (weakref.ref(offs), key, value)
        return value

    def _grouped(self, a, sa, b, sb, offs, out_dtype):
        M, K = a.shape
        G = b.shape[0]
        dst, layout, M_pad = self._layout(offs, M, G)
        a_pad = torch.empty(M_pad, K, dtype=torch.uint8, device=a.device)  # padding rows: layout -1, skipped
        a_pad.index_copy_(0, dst, a.view(torch.uint8))
        sa_pad = torch.empty_strided((M_pad, sa.shape[1]), (1, M_pad), dtype=sa.dtype, device=a.device)
        sa_pad.index_copy_(0, dst, sa)
        return self._run_grouped(a_pad.view(FP8_DTYPE), sa_pad, b, sb, layout, dst, M_pad, out_dtype)

    def _run_grouped(self, a_pad, sa_pad, b, sb, layout, dst, M_pad, out_dtype):
        out = torch.empty(M_pad, b.shape[1], dtype=torch.bfloat16, device=a_pad.device)
        self._new_shape("grouped", a_pad, b)
        self.dg.m_grouped_fp8_gemm_nt_contiguous((_pad_k(a_pad), sa_pad), (_pad_k(b), sb), out, layout)
        return _as(out.index_select(0, dst), out_dtype)


def padded_rows(rows: int, groups: int, align: int) -> int:
    """The grouped GEMM's M for ``rows`` expert rows over ``groups`` experts, each padded to ``align``:
    a bound that depends on the total alone (no host sync on the per-expert counts)."""
    return ceil_div(rows + groups * (align - 1), align) * align


def gemm_x(backend: GemmBackend, x, ue8m0: bool, b, sb, out_dtype):
    """``x [..., K]`` times the 128x128-block ``b [N, K]`` -> ``[..., N]``: ``x``'s 1x128 quantization
    (shared with the previous call on the same tensor), then, with ``backend.fused_rows``, a CUDA
    batch that :func:`rlcli.ops.fp8.linear_triton.serves` through its kernel, any other through
    ``backend.gemm``. Where the backend's GEMM wants whole 128-row tiles (``row_align``, scaled_mm),
    the quantization appends the zero rows in the same pass, so ``gemm`` copies nothing to pad."""
    x2 = x.reshape(-1, x.shape[-1])
    M, align = x2.shape[0], getattr(backend, "row_align", 1)
    (xq, xs), _ = runtime.quantize_input(x, ue8m0, cols=False, rows_to=ceil_div(M, align) * align)
    if getattr(backend, "fused_rows", False) and x.is_cuda and linear_triton.serves(M, x2.shape[1], b.shape[0]):
        y = linear_triton.linear(xq[:M], b, sb, ue8m0, out_dtype, xs=xs[:M])
    else:
        y = backend.gemm(xq, xs, b, sb, out_dtype)[:M]
    return y.view(*x.shape[:-1], y.shape[-1])


def grouped_gemm_x(backend: GemmBackend, x, ue8m0: bool, b, sb, offs, out_dtype):
    """``x``'s 1x128 quantization (shared with the previous call on the same tensor) times the grouped ``b``."""
    (xq, xs), _ = runtime.quantize_input(x, ue8m0, cols=False)
    return backend.grouped_gemm(xq, xs, b, sb, offs, out_dtype)


def _cuda_ms(fn, reps: int = 3) -> float:
    """Median device time of ``fn()`` (ms), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def import_deep_gemm():
    """The deep_gemm module, from a standalone install or vLLM's bundled copy; None if neither imports."""
    for name in ("deep_gemm", "vllm.third_party.deep_gemm"):
        try:
            import importlib

            dg = importlib.import_module(name)
            if hasattr(dg, "fp8_gemm_nt"):
                return dg
        except (ImportError, OSError, RuntimeError, AssertionError) as e:  # no CUDA toolkit: its init asserts
            log.debug("cannot import %s: %s", name, e)
    return None


def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def make_backend(name: BackendName = "auto", device: torch.device | str = "cpu",
                 inference: bool = False) -> GemmBackend:
    """The GEMM backend ``name`` for ``device``; ``auto`` prefers deep_gemm, then torch, then emulated.
    The torch backend's grouped GEMMs (MoE experts) run in :mod:`rlcli.ops.fp8.grouped_triton`, one
    kernel reading the offsets on the device, instead of a loop of ``scaled_mm`` over the experts.
    ``inference`` (FP8 weights, the native engine): with either kernel backend, a decode batch's
    linear (:func:`rlcli.ops.fp8.linear_triton.serves`) runs in that module's kernel.
    Raises ConfigError naming the config key when a requested backend cannot run here."""
    device = torch.device(device)
    if name in ("auto", "deep_gemm") and device.type == "cuda":
        dg = import_deep_gemm()
        if dg is not None:
            backend = DeepGemmBackend(dg, inference=inference)
            log.info("fp8 GEMM backend: deep_gemm %s%s", getattr(dg, "__version__", "?"),
                     ", decode rows in Triton" if backend.fused_rows else "")
            return backend
        if name == "deep_gemm":
            raise ConfigError("fp8.backend = 'deep_gemm' but deep_gemm does not import; install it or set "
                              "fp8.backend = 'auto'")
    if name in ("auto", "torch") and _is_sm90(device):
        backend = TorchScaledMMBackend(inference=inference)
        log.info("fp8 GEMM backend: torch scaled_mm (blockwise 1x128 x 128x128)%s%s",
                 ", grouped GEMMs in Triton" if backend.grouped_on_device else "",
                 ", decode rows in Triton" if backend.fused_rows else "")
        return backend
    if name in ("deep_gemm", "torch"):
        raise ConfigError(f"fp8.backend = {name!r} needs a Hopper (SM90) CUDA device, got {device}; "
                          "set fp8.backend = 'emulated' or 'auto'")
    log.info("fp8 GEMM backend: emulated (dequantize + fp32 matmul) on %s", device)
    return EmulatedBackend()
