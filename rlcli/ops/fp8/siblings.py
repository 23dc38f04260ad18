"""Sibling FP8 linears that read the same input (q/k/v, gate/up) run as one FP8 GEMM per pass.

``convert_to_fp8`` groups the FP8 linears of one parent named as a sibling set listed in
``fp8.fuse_siblings`` (``qkv``: ``q_proj, k_proj, v_proj``; ``gate_up``: ``gate_proj, up_proj``) when they share
``in_features``, have no bias, and every ``out_features`` is a multiple of 128: then no
128x128 block straddles two weights, so the blocks of the stacked weight ``[W_q; W_k; W_v]``
are the stacked blocks of each, and the stacked GEMM computes exactly the members' outputs.

The first member's call computes every member's output with one GEMM (its input quantized
once, the members' cached FP8 weights stacked once per optimizer step), returns its slice and
keeps the others for the siblings' calls on the same, unchanged tensor. The backward pass
receives all output gradients at once, concatenates them (one copy) and runs one quantization,
one dgrad and one wgrad GEMM instead of one per member, and no sum of the members' input
gradients. Per layer of a Llama that is 2 GEMM launches instead of 5 per pass. A member called
on another tensor, or before its leader, runs alone (the plain FP8 path): the result is the
same up to the fp32 summation order of the input gradient.

The members' outputs are column slices of the stacked output, so the ops that read them see
strided tensors. On the H200 (1.14B Llama, both sets stacked) the FP8 step's generic, non-vectorized
binary elementwise kernel took 13.3 ms against 7.6 ms in the previous session's unstacked run (not
isolated; strided SwiGLU inputs are the likely cause), so rl-train stacks only q/k/v by default
(their outputs feed the rotary embedding, 4x smaller than the SwiGLU's) and ``gate_up`` is
opt-in. Measured on its own in the real rl-train step with compiled blocks (1.1B Llama, one H200,
``bench/trainer_node.py --model llama-1b --compile --arms bf16,fp8-gate-up``): 0.97x bf16's speed
against q/k/v alone's 1.03x (in an earlier call), the elementwise work 0.091 s against 0.083 s a step.
"""

import weakref

import torch
import torch.nn as nn

from rlcli.ops.fp8.backends import GemmBackend
from rlcli.ops.fp8.quant import BLOCK, FP8_DTYPE
from rlcli.ops.fp8.runtime import quantize_act, quantize_input

SIBLING_SETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def _cat_fp8(ts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat([t.view(torch.uint8) for t in ts], dim).view(FP8_DTYPE)


class SiblingGroup:
    """The FP8 linears of one sibling set, the stacked FP8 weight, and the outputs not yet taken."""

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        self.splits = [m.out_features for m in members]
        self._parts = self._stacked = None
        self._pending = None  # (weakref to x, x version, taken flags, outputs)

    def stacked_weight(self, ue8m0: bool):
        """``((q, s), (qt, st))`` of the stacked weight, rebuilt when any member's cache re-quantized."""
        parts = [m.cache.get(m.weight, ue8m0, transposed=True) for m in self.members]
        if self._parts is None or any(a[0][0] is not b[0][0] for a, b in zip(parts, self._parts)):
            q, s = _cat_fp8([p[0][0] for p in parts], 0), torch.cat([p[0][1] for p in parts], 0)
            qt, st = _cat_fp8([p[1][0] for p in parts], 1), torch.cat([p[1][1] for p in parts], 1)
            self._parts, self._stacked = parts, ((q, s), (qt, st))
        return self._stacked

    def output(self, member: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``member(x)`` from one stacked GEMM, or None when ``member`` must run alone."""
        if x.is_inference():
            return None  # no version counter to key the siblings' reuse on: plain path
        idx = member.sibling_idx
        p = self._pending
        if p is not None and p[0]() is x and p[1] == x._version and not p[2][idx]:
            p[2][idx] = True
            if all(p[2]):
                self._pending = None
            return p[3][idx]
        if idx != 0:
            return None
        lead = self.members[0]
        outs = _FP8SiblingsFn.apply(x, self, lead.backend, lead.ue8m0, *[m.weight for m in self.members])
        self._pending = (weakref.ref(x), x._version, [True] + [False] * (len(outs) - 1), outs)
        return outs[0]


class _FP8SiblingsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: SiblingGroup, backend: GemmBackend, ue8m0: bool, *weights):
        need_dw = any(ctx.needs_input_grad[4:])
        (xq, xs), xt = quantize_input(x, ue8m0, cols=need_dw)
        (wq, ws), (wtq, wts) = group.stacked_weight(ue8m0)
        y = backend.gemm(xq, xs, wq, ws, x.dtype)
        xtq, xts = xt if need_dw else (None, None)
        ctx.save_for_backward(xtq, xts)
        ctx.wt, ctx.backend, ctx.ue8m0, ctx.splits = (wtq, wts), backend, ue8m0, group.splits
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weights[0].dtype
        return tuple(y.view(*x.shape[:-1], y.shape[-1]).split(group.splits, dim=-1))

    @staticmethod
    def backward(ctx, *dys):
        xtq, xts = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[4:])
        dy = torch.cat([d.reshape(-1, d.shape[-1]) for d in dys], dim=1)
        dx, dws = None, [None] * len(dys)
        if need_dx and need_dw:
            (dyq, dys_), (dytq, dyts) = quantize_act(dy, ctx.ue8m0, rows=True, cols=True)
        elif need_dx:
            dyq, dys_ = quantize_act(dy, ctx.ue8m0)
        elif need_dw:
            dytq, dyts = quantize_act(dy, ctx.ue8m0, rows=False, cols=True)
        if need_dx:
            wtq, wts = ctx.wt
            dx = ctx.backend.gemm(dyq, dys_, wtq, wts, ctx.x_dtype).view(ctx.x_shape)
        if need_dw:
            dws = list(ctx.backend.gemm_1x128(dytq, dyts, xtq, xts, ctx.w_dtype).split(ctx.splits, dim=0))
        return (dx, None, None, None, *dws)


def group_siblings(model: nn.Module, fp8_linear_type: type, sets=("qkv", "gate_up")) -> list[str]:
    """Attach a :class:`SiblingGroup` to every sibling set named in ``sets`` (keys of ``SIBLING_SETS``)
    whose FP8 linears qualify (see module note); returns the parents' names."""
    grouped = []
    for name, parent in model.named_modules():
        for names in (SIBLING_SETS[k] for k in sets):
            members = [getattr(parent, n, None) for n in names]
            if not all(type(m) is fp8_linear_type and not m.fp8_storage for m in members):
                continue
            if (len({m.in_features for m in members}) != 1 or any(m.bias is not None for m in members)
                    or any(m.out_features % BLOCK for m in members)
                    or len({(m.backend, m.ue8m0) for m in members}) != 1):
                continue
            group = SiblingGroup(members)
            for i, m in enumerate(members):
                m.sibling_group, m.sibling_idx = group, i
            grouped.append(f"{name}.{{{','.join(names)}}}")
    return grouped
