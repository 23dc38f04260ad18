"""FP8 linear and grouped (MoE expert) GEMMs with their own autograd, the DeepSeek-V3 recipe.

For ``y = x W^T`` (x [M, K] tokens, W [N, K] the high-precision master weight):

    forward   y  = Q1x128(x)  . Q128x128(W)^T              1x128 tiles along K
    dgrad     dx = Q1x128(dy) . Q128x128(W)                1x128 tiles along N; W^T's blocks are
                                                             W's blocks transposed (no requantization)
    wgrad     dW = Q1x128(dy^T) . Q1x128(x^T)^T            tiles of 128 *tokens*: the contraction
                                                             runs over tokens, so both operands are
                                                             scaled along it (DeepSeek-V3's 128x1
                                                             activation tiles for the backward pass)

Scaling always runs along the contraction dimension, so one outlier only coarsens its own
128-wide group. Every GEMM accumulates in fp32; y and dx come back in x's dtype, dW in
fp32 (then cast to the master weight's dtype). The bias and all non-GEMM math stay in
high precision. x is saved for the backward pass in its own dtype (quantized along tokens
there), not in FP8: simpler, at the cost of activation memory.

The weight is quantized on the fly from the master weight in every training forward (its
transpose for the input gradient is read off the same blocks); :class:`WeightCache` keeps
the FP8 copy across forwards only when no gradient is recorded (inference), until the
weight's version counter moves.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from rlcli.ops.fp8.backends import GemmBackend, group_ranges
from rlcli.ops.fp8 import quant
from rlcli.ops.fp8.quant import transpose_blocks

# The quantizers the layers call; compile_quantizers() swaps in fused (torch.compile) versions.
_Q = {"1x128": quant.quantize_1x128, "128x128": quant.quantize_128x128}


def quantize_1x128(x: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _Q["1x128"](x, ue8m0)


def quantize_128x128(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _Q["128x128"](w, ue8m0)


def compile_quantizers() -> None:
    """Fuse the quantizers' amax / scale / cast passes with torch.compile (GPU: eager runs ~6 kernels
    per quantization). Same arithmetic, so results match the eager reference."""
    _Q["1x128"] = torch.compile(quant.quantize_1x128, dynamic=True)
    _Q["128x128"] = torch.compile(quant.quantize_128x128, dynamic=True)


class WeightCache:
    """FP8 copy of one weight, refreshed when the weight changes (in-place updates bump ``_version``)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.q = self.s = self.qt = self.st = None

    def get(self, w: torch.Tensor, ue8m0: bool, transposed: bool = False):
        key = (w.data_ptr(), w._version, w.shape, ue8m0)
        if key != self.key:
            self.key = key
            self.q, self.s = quantize_128x128(w.detach(), ue8m0)
            self.qt = self.st = None
        if not transposed:
            return self.q, self.s
        if self.qt is None:
            self.qt, self.st = transpose_blocks(self.q, self.s)
        return self.qt, self.st


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache: WeightCache | None, backend: GemmBackend, ue8m0: bool):
        x2 = x.reshape(-1, x.shape[-1])
        wq, ws = weight_fp8(weight, cache, ue8m0)
        xq, xs = quantize_1x128(x2, ue8m0)
        y = backend.gemm(xq, xs, wq, ws, x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x2, weight, wq, ws)
        ctx.cache, ctx.backend, ctx.ue8m0, ctx.has_bias = cache, backend, ue8m0, bias is not None
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, wq, ws = ctx.saved_tensors
        backend, ue8m0 = ctx.backend, ctx.ue8m0
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            wtq, wts = transpose_blocks(wq, ws)
            dyq, dys = quantize_1x128(dy2, ue8m0)
            dx = backend.gemm(dyq, dys, wtq, wts, x2.dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = wgrad(backend, dy2, x2, ue8m0).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0)
        return dx, dw, db, None, None, None


def weight_fp8(w: torch.Tensor, cache: WeightCache | None, ue8m0: bool):
    """The weight's 128x128 quantization, from ``cache`` when one is given (see :func:`_cache_for`)."""
    return quantize_128x128(w.detach(), ue8m0) if cache is None else cache.get(w, ue8m0)


def _cache_for(w: torch.Tensor, cache: WeightCache | None) -> WeightCache | None:
    """Cache only when no gradient is recorded (inference: weights change only through in-place
    loads, which bump the version). A training forward re-quantizes: fused optimizers update
    parameters without bumping their version counter, so a cache keyed on it would serve a stale
    weight. Decided outside autograd.Function.forward, where grad mode is always off."""
    return None if torch.is_grad_enabled() and w.requires_grad else (cache or WeightCache())


def wgrad(backend: GemmBackend, dy_MN: torch.Tensor, x_MK: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """dW [N, K] = dy^T x in fp32, both operands in 1x128 tiles along the tokens."""
    if dy_MN.shape[0] == 0:
        return dy_MN.new_zeros(dy_MN.shape[1], x_MK.shape[1], dtype=torch.float32)
    aq, sa = quantize_1x128(dy_MN.t(), ue8m0)
    bq, sb = quantize_1x128(x_MK.t(), ue8m0)
    return backend.gemm_1x128(aq, sa, bq, sb, torch.float32)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: GemmBackend,
               cache: WeightCache | None = None, ue8m0: bool = False) -> torch.Tensor:
    """``F.linear`` in FP8 (see module docstring); differentiable in x, weight and bias."""
    return _FP8LinearFn.apply(x, weight, bias, _cache_for(weight, cache), backend, ue8m0)


class FP8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in FP8.

    Two storages: a high-precision master ``weight`` quantized on the fly (training; same
    parameters and state dict as the Linear it replaces), or, after :meth:`to_fp8_storage`,
    an FP8 ``weight`` plus its ``weight_scale_inv`` block scales, DeepSeek-V3's checkpoint
    layout (inference only: no gradients flow into an FP8 weight).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 backend: GemmBackend | None = None, ue8m0: bool = False):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.backend, self.ue8m0 = backend, ue8m0
        self.cache = WeightCache()

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: GemmBackend, ue8m0: bool = False) -> "FP8Linear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameters: optimizer state and FSDP see no change
        new.backend, new.ue8m0, new.cache = backend, ue8m0, WeightCache()
        return new

    @property
    def fp8_storage(self) -> bool:
        return self.weight.dtype == quant.FP8_DTYPE

    @torch.no_grad()
    def to_fp8_storage(self) -> None:
        """Replace the master weight by its 128x128 quantization (meta stays meta: shapes only)."""
        w = self.weight
        if w.is_meta:
            q = torch.empty(w.shape, dtype=quant.FP8_DTYPE, device="meta")
            s = torch.empty(quant.ceil_div(w.shape[0], quant.BLOCK), quant.ceil_div(w.shape[1], quant.BLOCK),
                            device="meta")
        else:
            q, s = quant.quantize_128x128(w, self.ue8m0)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale_inv", s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_meta:
            return F.linear(x, self.weight, self.bias)
        if self.fp8_storage:
            xq, xs = quantize_1x128(x.reshape(-1, x.shape[-1]), self.ue8m0)
            y = self.backend.gemm(xq, xs, self.weight, self.weight_scale_inv, x.dtype)
            y = y if self.bias is None else y + self.bias.to(y.dtype)
            return y.view(*x.shape[:-1], -1)
        return fp8_linear(x, self.weight, self.bias, self.backend, self.cache, self.ue8m0)

    def extra_repr(self) -> str:
        store = ", fp8 weights" if self.fp8_storage else ""
        return f"{super().extra_repr()}, fp8={self.backend.name}{', ue8m0' if self.ue8m0 else ''}{store}"


class _FP8GroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, cache: WeightCache | None, backend: GemmBackend, ue8m0: bool):
        wq, ws = weight_fp8(w, cache, ue8m0)
        xq, xs = quantize_1x128(x, ue8m0)
        y = backend.grouped_gemm(xq, xs, wq, ws, offs, x.dtype)
        ctx.save_for_backward(x, w, offs, wq, ws)
        ctx.cache, ctx.backend, ctx.ue8m0 = cache, backend, ue8m0
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, offs, wq, ws = ctx.saved_tensors
        backend, ue8m0 = ctx.backend, ctx.ue8m0
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wtq, wts = transpose_blocks(wq, ws)
            dyq, dys = quantize_1x128(dy, ue8m0)
            dx = backend.grouped_gemm(dyq, dys, wtq, wts, offs, x.dtype)
        if ctx.needs_input_grad[1]:
            # Token tiles must not straddle two experts: each group is quantized on its own.
            dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            for g, (s, e) in enumerate(group_ranges(offs)):
                if e > s:
                    dw[g] = wgrad(backend, dy[s:e], x[s:e], ue8m0)
            dw = dw.to(w.dtype)
        return dx, dw, None, None, None, None


def fp8_grouped_mm(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor, backend: GemmBackend,
                   cache: WeightCache | None = None, ue8m0: bool = False) -> torch.Tensor:
    """Rows ``offs[g-1]:offs[g]`` of ``x`` times ``w[g]^T`` in FP8; the FP8 twin of
    ``F.grouped_mm(x, w.transpose(-2, -1), offs=offs)``. ``offs`` holds int32 cumulative row ends."""
    return _FP8GroupedFn.apply(x_MK, w_GNK, offs_G, _cache_for(w_GNK, cache), backend, ue8m0)
