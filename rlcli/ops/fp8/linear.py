"""FP8 linear and grouped (MoE expert) GEMMs with their own autograd, the DeepSeek-V3 recipe.

For ``y = x W^T`` (x [M, K] tokens, W [N, K] the high-precision master weight):

    forward   y  = Q1x128(x)  . Q128x128(W)^T              1x128 tiles along K
    dgrad     dx = Q1x128(dy) . Q128x128(W)                1x128 tiles along N; W^T's blocks are
                                                             W's blocks transposed (no requantization)
    wgrad     dW = Q1x128(dy^T) . Q1x128(x^T)^T            tiles of 128 *tokens*: the contraction
                                                             runs over tokens, so both operands are
                                                             scaled along it (DeepSeek-V3's 128x1
                                                             activation tiles for the backward pass)

All three GEMMs run in FP8 and accumulate in fp32; y and dx come back in x's dtype, dW in the
weight's dtype. The bias and all non-GEMM math stay in high precision. In the forward pass x
is quantized both ways in one pass (along K for y, along tokens for dW), and only the FP8
``x^T`` is saved for the backward pass (1 byte per element instead of 2); in the backward
pass dy is quantized both ways in one pass too.

MoE experts (:func:`fp8_grouped_mm`): forward and dgrad are FP8 grouped GEMMs. The weight
gradient of bf16 experts is one bf16 grouped GEMM over all experts (torch's k-grouped
``grouped_mm``, no host sync) where that kernel runs (CUDA, and CPU from torch 2.13): there
is no FP8 k-grouped GEMM on SM90 here, and a per-expert loop of small FP8 GEMMs (one host
sync, token tiles quantized per expert so none straddles two) was several times slower than
bf16. That loop remains for fp32 experts and where the kernel is missing.

The weight is quantized once per optimizer step, and activations shared by several linears
once (see :mod:`rlcli.ops.fp8.runtime`). Under ``torch.compile`` an :class:`FP8Linear` (and
the FP8 experts' GEMMs) runs eagerly by default, outside the graph (``fp8.graph = "eager"``):
dynamo tracing into the caches broke the graph at every data-pointer and version check and
compiled new frames for each layer. With ``fp8.graph = "fused"`` it takes the stateless twin of
this recipe in :mod:`rlcli.ops.fp8.graph`, which traces into the graph.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from rlcli.ops.fp8 import quant
from rlcli.ops.fp8.backends import GemmBackend, group_ranges
from rlcli.ops.fp8.graph import backend_key, graph_fp8_linear
from rlcli.ops.fp8.runtime import WeightCache, quantize_act, quantize_input, weight_fp8
from rlcli.ops.grouped_gemm import _grouped_mm_op, kgrouped_available


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache: WeightCache | None, backend: GemmBackend, ue8m0: bool):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        (xq, xs), xt = quantize_input(x, ue8m0, cols=need_dw)
        wq, ws = _forward_weight(weight, cache, ue8m0, need_dx)
        y = backend.gemm(xq, xs, wq, ws, x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        xtq, xts = xt if need_dw else (None, None)
        ctx.save_for_backward(xtq, xts, weight)
        ctx.cache, ctx.backend, ctx.ue8m0, ctx.has_bias = cache, backend, ue8m0, bias is not None
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xtq, xts, weight = ctx.saved_tensors
        backend, ue8m0 = ctx.backend, ctx.ue8m0
        dy2 = dy.reshape(-1, dy.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = db = None
        if need_dx and need_dw:
            (dyq, dys), (dytq, dyts) = quantize_act(dy2, ue8m0, rows=True, cols=True)
        elif need_dx:
            dyq, dys = quantize_act(dy2, ue8m0)
        elif need_dw:
            dytq, dyts = quantize_act(dy2, ue8m0, rows=False, cols=True)
        if need_dx:
            _, (wtq, wts) = weight_fp8(weight, ctx.cache, ue8m0, transposed=True, backward=True)
            dx = backend.gemm(dyq, dys, wtq, wts, ctx.x_dtype).view(ctx.x_shape)
        if need_dw:
            dw = backend.gemm_1x128(dytq, dyts, xtq, xts, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0)
        return dx, dw, db, None, None, None


def _forward_weight(w: torch.Tensor, cache: WeightCache, ue8m0: bool, need_dx: bool):
    """The forward's weight blocks; when dx will be needed the transpose is made in the same pass (cached)."""
    return weight_fp8(w, cache, ue8m0, transposed=True)[0] if need_dx else weight_fp8(w, cache, ue8m0)


def _cache_for(cache: WeightCache | None) -> WeightCache:
    return cache if cache is not None else WeightCache()


def wgrad(backend: GemmBackend, dy_MN: torch.Tensor, x_MK: torch.Tensor, ue8m0: bool,
          out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dW [N, K] = dy^T x, both operands in 1x128 tiles along the tokens."""
    if dy_MN.shape[0] == 0:
        return dy_MN.new_zeros(dy_MN.shape[1], x_MK.shape[1], dtype=out_dtype)
    aq, sa = quantize_act(dy_MN, ue8m0, rows=False, cols=True)
    bq, sb = quantize_act(x_MK, ue8m0, rows=False, cols=True)
    return backend.gemm_1x128(aq, sa, bq, sb, out_dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: GemmBackend,
               cache: WeightCache | None = None, ue8m0: bool = False) -> torch.Tensor:
    """``F.linear`` in FP8 (see module docstring); differentiable in x, weight and bias."""
    return _FP8LinearFn.apply(x, weight, bias, _cache_for(cache), backend, ue8m0)


GRAPH_MODES = ("eager", "fused")


class FP8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in FP8.

    Two storages: a high-precision master ``weight`` quantized once per optimizer step (training; same
    parameters and state dict as the Linear it replaces), or, after :meth:`to_fp8_storage`,
    an FP8 ``weight`` plus its ``weight_scale_inv`` block scales, DeepSeek-V3's checkpoint
    layout (inference only: no gradients flow into an FP8 weight).

    ``graph`` says what a compiled caller traces (module docstring): ``"eager"`` (a graph break;
    this class's caches and sibling stacking) or ``"fused"`` (:mod:`rlcli.ops.fp8.graph`, the linear
    in the graph). Eager callers always take the cached path.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 backend: GemmBackend | None = None, ue8m0: bool = False, graph: str = "eager"):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(backend, ue8m0, graph)

    def _setup(self, backend: GemmBackend | None, ue8m0: bool, graph: str) -> None:
        if graph not in GRAPH_MODES:
            raise ValueError(f"fp8.graph must be one of {', '.join(GRAPH_MODES)}, got {graph!r}")
        self.backend, self.ue8m0, self.graph = backend, ue8m0, graph
        self.cache = WeightCache()
        self.sibling_group, self.sibling_idx = None, 0  # set by siblings.group_siblings

    @property
    def backend(self) -> GemmBackend | None:
        return self._backend

    @backend.setter
    def backend(self, value: GemmBackend | None) -> None:
        self._backend = value
        self._backend_key = None if value is None else backend_key(value)  # looked up outside any trace

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: GemmBackend, ue8m0: bool = False,
                    graph: str = "eager") -> "FP8Linear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameters: optimizer state and FSDP see no change
        new._setup(backend, ue8m0, graph)
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
        if torch.compiler.is_compiling() and self.graph != "eager" and not self.weight.is_meta and not self.fp8_storage:
            return graph_fp8_linear(x, self.weight, self.bias, self.backend, self.ue8m0, self._backend_key)
        return self._eager_forward(x)

    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_meta:
            return F.linear(x, self.weight, self.bias)
        if self.fp8_storage:
            y = self.backend.gemm_x(x, self.ue8m0, self.weight, self.weight_scale_inv, x.dtype)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if self.sibling_group is not None:  # q/k/v or gate/up as one GEMM (rlcli.ops.fp8.siblings)
            y = self.sibling_group.output(self, x)
            if y is not None:
                return y
        return fp8_linear(x, self.weight, self.bias, self.backend, self.cache, self.ue8m0)

    def extra_repr(self) -> str:
        store = ", fp8 weights" if self.fp8_storage else ""
        fused = ", stacked with siblings" if self.sibling_group is not None else ""
        graph = "" if self.graph == "eager" else f", graph={self.graph}"
        return f"{super().extra_repr()}, fp8={self.backend.name}{', ue8m0' if self.ue8m0 else ''}{store}{fused}{graph}"


def _bf16_kgrouped(dy: torch.Tensor, x: torch.Tensor) -> bool:
    return dy.dtype == torch.bfloat16 and kgrouped_available(dy, x)


class _FP8GroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, cache: WeightCache | None, backend: GemmBackend, ue8m0: bool):
        wq, ws = _forward_weight(w, cache, ue8m0, ctx.needs_input_grad[0])
        y = backend.grouped_gemm_x(x, ue8m0, wq, ws, offs, x.dtype)  # gate and up share x's quantization
        ctx.save_for_backward(x, w, offs)
        ctx.cache, ctx.backend, ctx.ue8m0 = cache, backend, ue8m0
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()  # the k-grouped GEMM reads dy^T as a column-major matrix
        backend, ue8m0 = ctx.backend, ctx.ue8m0
        dx = dw = None
        if ctx.needs_input_grad[0]:
            _, (wtq, wts) = weight_fp8(w, ctx.cache, ue8m0, transposed=True, backward=True)
            dx = backend.grouped_gemm_x(dy, ue8m0, wtq, wts, offs, x.dtype)
        if ctx.needs_input_grad[1]:
            if _bf16_kgrouped(dy, x):  # one bf16 kernel over all experts, no host sync (see module note)
                dw = _grouped_mm_op(dy.t(), x, offs=offs)
            else:  # token tiles must not straddle two experts: each group is quantized on its own
                dw = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
                for g, (s, e) in enumerate(group_ranges(offs)):
                    if e > s:
                        dw[g] = wgrad(backend, dy[s:e], x[s:e], ue8m0, w.dtype)
        return dx, dw, None, None, None, None


def fp8_grouped_mm(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor, backend: GemmBackend,
                   cache: WeightCache | None = None, ue8m0: bool = False) -> torch.Tensor:
    """Rows ``offs[g-1]:offs[g]`` of ``x`` times ``w[g]^T`` in FP8; the FP8 twin of
    ``F.grouped_mm(x, w.transpose(-2, -1), offs=offs)``. ``offs`` holds int32 cumulative row ends."""
    return _FP8GroupedFn.apply(x_MK, w_GNK, offs_G, _cache_for(cache), backend, ue8m0)
