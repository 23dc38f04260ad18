"""The native engine's fused layers (``infer.engine.fused_kernels``): the zoo's modules with their
elementwise work in the kernels of :mod:`rlcli.ops.fused_kernels`, swapped in from outside.

:func:`fuse_layers` changes the class of a model's modules in place (their parameters, buffers
and hooks stay where they are, so weight loads, CUDA graphs' fingerprints and state dicts are
unchanged), to a subclass whose ``forward`` runs the kernels where they serve the input (CUDA, no
autograd, one dtype) and the module's own otherwise:

- the transformer's layer loop carries the residual stream apart from each sublayer's output and
  adds the two inside the next norm (:func:`~rlcli.ops.fused_kernels.add_rms_norm`): per layer two
  kernels where the torch code ran two adds and two seven-kernel norms;
- every other RMSNorm (Qwen3's query and key norms outside the attention below, MLA's latent norms)
  is one kernel;
- grouped-query attention rotates its queries and keys, after Qwen3's per-head norms, in one
  kernel (:func:`~rlcli.ops.fused_kernels.rotary_`; the half-split layout over whole heads, the
  zoo's dense models; interleaved or partial rotaries keep the module's code), which in the
  engine's steps also writes the keys and values to their slots of the paged KV cache (then the
  backend only attends, :meth:`~rlcli.ops.attention.PagedAttention.attend`).

SwiGLU's gate needs no swap: the zoo's MLPs and MoE experts run it in one kernel on CUDA, in the
engine and the trainer alike (:func:`rlcli.ops.swiglu.swiglu`).

Only the inference engine swaps these in: they have no backward, and the trainer's numerics stay the
zoo's. What they change in the numbers is set out in :mod:`rlcli.ops.fused_kernels`.
"""

import functools
import os

import torch

from rlcli.models.layers import Attention, RMSNorm
from rlcli.models.transformer import DecoderLayer, TransformerModel
from rlcli.ops.attention import PagedAttention

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def kernels():
    """:mod:`rlcli.ops.fused_kernels`, or None where Triton does not import."""
    try:
        from rlcli.ops import fused_kernels
    except (ImportError, OSError):
        return None
    return fused_kernels


def _serves(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these: on CUDA (or CPU under Triton's interpreter), no autograd,
    one dtype."""
    x = tensors[0]
    return ((x.is_cuda or (_INTERPRET and x.device.type == "cpu")) and not torch.is_grad_enabled()
            and all(t.dtype == x.dtype for t in tensors))


class _FusedNorm:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _serves(x, self.weight):
            return kernels().add_rms_norm(x, None, self.weight, self.eps)[1]
        return super().forward(x)


class _FusedAttention:
    def forward(self, x_BTD: torch.Tensor, rope, cos_sin, ctx) -> torch.Tensor:
        cos, sin = cos_sin
        if rope.interleave or cos.shape[-1] != self.head_dim or self.head_dim % 2:
            return super().forward(x_BTD, rope, cos_sin, ctx)
        B, T, _ = x_BTD.shape
        q = self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else ()
        if not _serves(q, k, v, cos, sin, *norms):
            if norms:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope.apply(q, *cos_sin), rope.apply(k, *cos_sin)
            return self.o_proj(self.inner_attention(q, k, v, self.scale, ctx).reshape(B, T, -1))
        eps = self.q_norm.eps if norms else 0.0
        paged = ctx.attn if isinstance(ctx.attn, PagedAttention) and not ctx.attn.batch_invariant and B == 1 else None
        caches = paged.kv_caches[self.layer_idx] if paged is not None else ()
        if len(caches) == 2 and all(c.dtype == q.dtype and c.shape[2:] == k.shape[2:] for c in caches):
            # the engine's paged cache: the keys and values written to their slots by the same kernel
            kernels().rotary_(q, k, cos, sin, *norms, eps=eps, store=(v, *caches, paged.meta.slot_mapping))
            out = paged.attend(q[0], *caches, self.scale)[None]
        else:
            kernels().rotary_(q, k, cos, sin, *norms, eps=eps)
            out = self.inner_attention(q, k, v, self.scale, ctx)
        return self.o_proj(out.reshape(B, T, -1))


class _FusedTransformer:
    def forward(self, input_ids_BT, position_ids_BT, ctx) -> torch.Tensor:
        h = self.embed_tokens(input_ids_BT)
        if not (_serves(h, self.norm.weight) and all(_plain_norms(layer) for layer in self.layers)):
            return super().forward(input_ids_BT, position_ids_BT, ctx)
        k = kernels()
        cos_sin = self.rotary_emb(position_ids_BT, h.dtype)
        residual = None  # the stream: the last sublayer's output h is added to it inside the next norm
        for layer in self.layers:
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            residual, x = k.add_rms_norm(h, residual, ln1.weight, ln1.eps)
            if residual is None:
                residual = h
            h = layer.self_attn(x, self.rotary_emb, cos_sin, ctx)
            residual, x = k.add_rms_norm(h, residual, ln2.weight, ln2.eps)
            h = layer.mlp(x, ctx)
        return k.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[1]


def _plain_norms(layer: torch.nn.Module) -> bool:
    """The layer is the zoo's DecoderLayer with plain RMSNorms (not another swap's, e.g.
    ``model.batch_invariant``'s)."""
    return type(layer) is DecoderLayer and all(type(n) in (RMSNorm, _swaps()[RMSNorm])
                                               for n in (layer.input_layernorm, layer.post_attention_layernorm))


@functools.cache
def _swaps() -> dict[type, type]:
    """Each class swapped, and its fused subclass."""
    mixins = ((TransformerModel, _FusedTransformer), (RMSNorm, _FusedNorm), (Attention, _FusedAttention))
    return {base: type(f"Fused{base.__name__}", (mixin, base), {}) for base, mixin in mixins}


def fuse_layers(model: torch.nn.Module) -> str | None:
    """Swap the fused classes into ``model`` in place; None, or why nothing was swapped (no Triton).
    Only modules of exactly the zoo's classes are swapped (and FP8's experts, which keep their
    GEMMs): a subclass with a forward of its own keeps it. Idempotent."""
    if kernels() is None:
        return "the fused kernels need Triton"
    swaps = _swaps()
    for module in model.modules():
        cls = swaps.get(type(module))
        if cls is not None:
            module.__class__ = cls
    return None
