"""FP8 linears inside ``torch.compile`` graphs (rl-train --compile --fp8, ``train.fp8.graph = "fused"``).

The eager FP8 linear (:mod:`rlcli.ops.fp8.linear`) keeps Python state between calls: a weight
cache keyed on data pointers and versions, the last input's quantization, stacked siblings.
Dynamo cannot trace that, so under compilation it runs outside the graph, a break per call
(``fp8.graph = "eager"``, the default). Here the same recipe (forward, dgrad and wgrad in FP8,
the same block shapes and scale formula) is written so the whole linear traces:

* GEMMs are one custom op, ``rlcli::fp8_gemm``, opaque to the compiler: it calls the linear's
  backend (DeepGEMM, ``scaled_mm``, the CPU emulation), found by a registry key since an op's
  arguments cannot be Python objects, and lays the scales out for its kernel. (``scaled_mm``
  itself is no graph op on torch 2.11: dynamo breaks the graph at ``_scaled_mm_v2``.)
* Quantization is the torch reference of :mod:`rlcli.ops.fp8.quant`, which inductor compiles and
  fuses into its neighbours on CUDA: the RMSNorm or SwiGLU that produces a linear's input, the
  SwiGLU backward that produces an output gradient. Off CUDA it runs behind custom ops instead
  (``rlcli::fp8_quantize_act``, ``rlcli::fp8_quantize_weight``: the reference, eagerly): inductor's
  C++ backend (torch 2.13) fails an assertion in its loop splitting on the row and column
  quantizations of one gradient fused side by side.
* No weight cache: the weight is quantized (with its transpose, for dgrad) at every forward,
  one extra read of the weight per micro-batch, and the transposed FP8 blocks are saved for
  the backward pass (1 byte per weight element, held from forward to backward).
* No sibling stacking: q/k/v read the same input, and the compiler's common-subexpression
  elimination quantizes it once.

What it buys, measured (docs/benchmarks.md, 2026-12-04, one H200, the ~1B dense rl-train step,
4 rows of 8192 tokens, compiled, no activation checkpointing; two runs): no graph breaks and 25%
less peak memory than the eager FP8 path (18.6 against 24.8 GiB; bf16 21.1), but a slower step,
0.82-0.90x bf16's tokens/s against the eager path's 0.93-0.96x. The step stays host-bound: each
GEMM still crosses into Python (the custom op, DeepGEMM's launcher), about 1350 of them a step,
and inductor's fused quantization took more device time than rlcli's Triton quantizers (0.10 s
of quantization kernels a step against 0.04).

Quantization in the graph gives values of the reference formula; inductor's code may round a
scale differently from the Triton kernels in the last bit, so the compiled trainer's FP8 numerics
are the recipe's but not bit-identical to rl-infer's (``model.batch_invariant``, which gives
those bits, refuses ``train.compile`` altogether). FP8 MoE experts run eagerly between graph pieces.
"""

import itertools

import torch

from rlcli.ops.fp8 import quant, runtime
from rlcli.ops.fp8.backends import GemmBackend, _col_major

_BACKENDS: dict[str, GemmBackend] = {}
_KEYS: dict[int, str] = {}
_IDS = itertools.count()


def backend_key(backend: GemmBackend) -> str:
    """The registry key under which ``rlcli::fp8_gemm`` finds ``backend`` (registered on first use)."""
    key = _KEYS.get(id(backend))
    if key is None or _BACKENDS.get(key) is not backend:
        key = f"{backend.name}:{next(_IDS)}"
        _BACKENDS[key], _KEYS[id(backend)] = backend, key
    return key


@torch.library.custom_op("rlcli::fp8_gemm", mutates_args=())
def fp8_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, backend: str,
             weight_blocks: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T`` from FP8 operands: ``a`` in 1x128 tiles, ``b`` in 128x128 blocks
    (``weight_blocks``) or 1x128 tiles (weight gradients); scales in any layout."""
    impl = _BACKENDS[backend]
    sa = _col_major(sa)
    if weight_blocks:
        return impl.gemm(a, sa, b, sb.contiguous(), out_dtype)
    return impl.gemm_1x128(a, sa, b, _col_major(sb), out_dtype)


@fp8_gemm.register_fake
def _(a, sa, b, sb, backend, weight_blocks, out_dtype):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


def _fresh(x: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``outs`` with a copy of any that shares storage with ``x`` or an earlier one (a custom op's
    outputs may not alias; e.g. the transpose of a one-block-wide scale tensor is a view)."""
    seen = {x.untyped_storage().data_ptr()}
    fresh = []
    for t in outs:
        ptr = t.untyped_storage().data_ptr()
        fresh.append(t.clone(memory_format=torch.preserve_format) if ptr in seen else t)
        seen.add(fresh[-1].untyped_storage().data_ptr())
    return fresh


@torch.library.custom_op("rlcli::fp8_quantize_act", mutates_args=())
def fp8_quantize_act(x: torch.Tensor, ue8m0: bool, rows: bool, cols: bool) -> list[torch.Tensor]:
    """rlcli's one-pass quantizer (:func:`runtime.quantize_act`) as one op: ``[q, s]`` (``rows``)
    followed by ``[qt, st]`` (``cols``)."""
    out = runtime.quantize_act(x, ue8m0, rows, cols)
    pairs = out if rows and cols else (out,)
    return _fresh(x, [t.contiguous() if i % 2 == 0 else _col_major(t) for pair in pairs for i, t in enumerate(pair)])


@fp8_quantize_act.register_fake
def _(x, ue8m0, rows, cols):
    M, K = x.shape
    out = []
    for r, c in ((M, K),) * rows + ((K, M),) * cols:
        out += [x.new_empty(r, c, dtype=quant.FP8_DTYPE),
                torch.empty_strided((r, quant.ceil_div(c, quant.BLOCK)), (1, r), device=x.device)]
    return out


@torch.library.custom_op("rlcli::fp8_quantize_weight", mutates_args=())
def fp8_quantize_weight(w: torch.Tensor, ue8m0: bool) -> list[torch.Tensor]:
    """``[q, s, qt, st]``: the 128x128 blocks of ``w [N, K]`` and of ``w^T`` (:func:`runtime.quantize_weight`)."""
    (q, s), (qt, st) = runtime.quantize_weight(w.detach(), ue8m0, transposed=True)
    return _fresh(w, [q, s.contiguous(), qt, st.contiguous()])


@fp8_quantize_weight.register_fake
def _(w, ue8m0):
    N, K = w.shape
    nb, kb = quant.ceil_div(N, quant.BLOCK), quant.ceil_div(K, quant.BLOCK)
    return [w.new_empty(N, K, dtype=quant.FP8_DTYPE), w.new_empty(nb, kb, dtype=torch.float32),
            w.new_empty(K, N, dtype=quant.FP8_DTYPE), w.new_empty(kb, nb, dtype=torch.float32)]


def _tiles_down_columns(x: torch.Tensor, ue8m0: bool) -> list[torch.Tensor]:
    """``quant.quantize_1x128(x.t())`` (the same values), as 128-row tiles of ``x`` reduced down each
    column, the FP8 data transposed at the end: the reduction reads ``x`` along its rows."""
    M, K = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, 0, 0, (-M) % quant.BLOCK))
    tiles = xp.unflatten(0, (-1, quant.BLOCK))  # [Mb, 128, K]
    s, r = quant._scale(tiles.abs().amax(dim=1), ue8m0)  # [Mb, K]
    q = quant._cast(tiles * r[:, None, :]).flatten(0, 1)[:M]
    return [q.t().contiguous(), s.t()]


def _act(x: torch.Tensor, ue8m0: bool, fused: bool, rows: bool, cols: bool) -> list[torch.Tensor]:
    if not fused:
        return fp8_quantize_act(x, ue8m0, rows, cols)
    out = list(quant.quantize_1x128(x, ue8m0)) if rows else []
    return out + _tiles_down_columns(x, ue8m0) if cols else out


def _weight(w: torch.Tensor, ue8m0: bool, fused: bool) -> list[torch.Tensor]:
    if not fused:
        return fp8_quantize_weight(w, ue8m0)
    q, s = quant.quantize_128x128(w.detach(), ue8m0)
    return [q, s, *quant.transpose_blocks(q, s)]


class _GraphFP8LinearFn(torch.autograd.Function):
    """The recipe of :mod:`rlcli.ops.fp8.linear`, stateless (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, backend: str, ue8m0: bool, fused: bool):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x2 = x.reshape(-1, x.shape[-1])
        N = weight.shape[0]
        act = _act(x2, ue8m0, fused, rows=True, cols=need_dw)
        wq, ws, wtq, wts = _weight(weight, ue8m0, fused)
        y = fp8_gemm(act[0], act[1], wq, ws, backend, True, x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(*(act[2:] if need_dw else (None, None)), *((wtq, wts) if need_dx else (None, None)))
        ctx.backend, ctx.ue8m0, ctx.fused, ctx.has_bias = backend, ue8m0, fused, bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return y.view(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        xtq, xts, wtq, wts = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if need_dx or need_dw:
            g = _act(dy2, ctx.ue8m0, ctx.fused, rows=need_dx, cols=need_dw)
            if need_dx:
                dx = fp8_gemm(g[0], g[1], wtq, wts, ctx.backend, True, ctx.x_dtype).view(ctx.x_shape)
            if need_dw:  # in the weight's dtype, as the cached linear computes it
                dw = fp8_gemm(g[-2], g[-1], xtq, xts, ctx.backend, False, ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0)
        return dx, dw, db, None, None, None


def graph_fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: GemmBackend,
                     ue8m0: bool = False, key: str | None = None) -> torch.Tensor:
    """``F.linear`` in FP8, traceable by dynamo with no graph break (module docstring); eager calls work too.
    ``key``: ``backend``'s :func:`backend_key`, looked up before tracing (the registry is Python state)."""
    key = key if key is not None else backend_key(backend)
    return _GraphFP8LinearFn.apply(x, weight, bias, key, ue8m0, x.is_cuda)
