"""DeepSeek-V3 family (DeepSeek-V3/R1, Kimi-K2): multi-head latent attention (MLA) and an
MoE with sigmoid routing, a selection-only score bias, group-limited top-k and shared
experts; the first ``first_k_dense_replace`` layers are dense.

MLA compresses keys and values into a ``kv_lora_rank`` latent plus one shared rotary key
of ``qk_rope_head_dim``; ``kv_b_proj`` expands the latent into per-head keys (no rope part)
and values. Two forms of the same function (:mod:`rlcli.ops.mla`):

* expanded (training and parity forwards of dense MLA): per-head K/V go to the attention
  backend, which runs ordinary causal attention (cheaper for long prefills: head dim 192,
  not 576);
* latent (the inference engine, and every forward of a DSA model): ``kv_b_proj`` is folded
  into the query and output sides, the paged cache holds the 576-value latent + rope key
  per token, and a DSA layer attends to its indexer's top-k tokens only.
"""

import torch
import torch.nn as nn

from rlcli.models.config import ModelArgs
from rlcli.models.indexer import Indexer
from rlcli.models.layers import RMSNorm, RotaryEmbedding, yarn_mscale
from rlcli.models.transformer import CausalLM
from rlcli.ops.attention import ForwardContext, InnerAttention, PagedAttention
from rlcli.ops.fp8.quant import dequantize_128x128
from rlcli.ops.mla import LatentQuery, SparseLatentAttention, paged_latent_attention


class MLAttention(nn.Module):
    batch_invariant = False  # True on rlcli.ops.invariant_layers._InvariantMLA (model.batch_invariant)

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        D, H, bias = args.hidden_size, self.num_heads, args.attention_bias
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(args.q_lora_rank, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=bias)
        self.scale = self.qk_dim ** -0.5
        scaling = args.rope_scaling or {}
        if scaling.get("mscale_all_dim"):
            m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
            self.scale = self.scale * m * m
        self.inner_attention = InnerAttention(layer_idx)

        # DSA: a layer runs its own indexer, or reuses the last indexer layer's choice (GLM-5 "shared").
        self.sparse = args.is_dsa
        self.indexer = Indexer(args) if args.is_dsa and layer_idx in args.indexer_layers else None
        self.index_source = max((i for i in args.indexer_layers if i <= layer_idx), default=layer_idx)
        self.sparse_attention = SparseLatentAttention(layer_idx) if args.is_dsa else None

    def kv_spec(self) -> tuple[tuple[int, int], ...]:
        """(heads, dim) of each paged cache tensor: the latent + rope key, and the indexer keys."""
        spec = ((1, self.kv_lora_rank + self.rope_dim),)
        return spec + ((1, self.indexer.head_dim),) if self.indexer is not None else spec

    def forward(self, x_BTD: torch.Tensor, rope: RotaryEmbedding, cos_sin, ctx: ForwardContext) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H = self.num_heads
        if hasattr(self, "q_proj"):
            q_resid, q = None, self.q_proj(x_BTD)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x_BTD))
            q = self.q_b_proj(q_resid)
        q_nope, q_rot = q.view(B, T, H, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rot = rope.apply(q_rot, *cos_sin)
        k_rot = rope.apply(k_rot.view(B, T, 1, self.rope_dim), *cos_sin)
        if self._latent_form(ctx):
            out = self._latent(x_BTD, q_resid, q_nope, q_rot, latent, k_rot[:, :, 0], rope, cos_sin, ctx)
            return self.o_proj(out.reshape(B, T, H * self.v_dim))
        kv = self.kv_b_proj(latent).view(B, T, H, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(B, T, H, self.rope_dim)], dim=-1)
        out = self.inner_attention(q, k, v, self.scale, ctx)
        return self.o_proj(out.reshape(B, T, H * self.v_dim))

    def _latent_form(self, ctx: ForwardContext) -> bool:
        """Whether this forward attends in latent form: the engine's paged cache and DSA always
        (the seam model.batch_invariant replaces: there the trainer computes the engine's form)."""
        return self.sparse or isinstance(ctx.attn, PagedAttention)

    def _kv_b_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``kv_b_proj``'s weight for absorption; an FP8 weight with DeepSeek's 128x128 block
        scales (``weight_scale_inv``, FP8 inference storage) is dequantized."""
        w = self.kv_b_proj.weight
        scale = getattr(self.kv_b_proj, "weight_scale_inv", None)
        if scale is None or w.dtype.itemsize != 1:
            return w
        return dequantize_128x128(w, scale, dtype)

    @staticmethod
    def _absorb_q(q_nope_BTHD: torch.Tensor, w_uk_HDR: torch.Tensor) -> torch.Tensor:
        """Each head's query through its key up-projection: ``[B, T, H, R]``."""
        return torch.einsum("bthd,hdr->bthr", q_nope_BTHD, w_uk_HDR)

    @staticmethod
    def _expand_out(out_BTHR: torch.Tensor, w_uv_HVR: torch.Tensor) -> torch.Tensor:
        """Each head's latent output through its value up-projection: ``[B, T, H, V]``."""
        return torch.einsum("bthr,hvr->bthv", out_BTHR, w_uv_HVR)

    def _latent(self, x_BTD, q_resid, q_nope, q_rot, latent_BTR, k_rot_BTd, rope, cos_sin, ctx) -> torch.Tensor:
        """Absorbed MLA: attention over [latent, rope key] per token; returns [B, T, H, v_dim]."""
        B, T, H, R = *q_nope.shape[:3], self.kv_lora_rank
        w_HXR = self._kv_b_weight(q_nope.dtype).view(H, self.nope_dim + self.v_dim, R)
        w_uk, w_uv = w_HXR[:, :self.nope_dim], w_HXR[:, self.nope_dim:]
        q_BTHL = torch.cat([self._absorb_q(q_nope, w_uk), q_rot], dim=-1)
        kv_BTL = torch.cat([latent_BTR, k_rot_BTd], dim=-1)
        index = self.indexer(x_BTD, q_resid, rope, cos_sin) if self.indexer is not None else None
        if isinstance(ctx.attn, PagedAttention):
            idx_args = None if index is None else (index[0][0], index[1][0], index[2][0], self.indexer.topk,
                                                    self.indexer.scale)
            shared = ctx.dsa_selection.get(self.index_source) if index is None else None
            out, sel = paged_latent_attention(ctx.attn, self.layer_idx, q_BTHL[0], kv_BTL[0], R, self.scale,
                                              idx_args, shared)
            if index is not None:
                ctx.dsa_selection[self.layer_idx] = sel
            out_BTHR = out[None]
        elif self.sparse_attention is None:  # dense MLA on packed rows (model.batch_invariant): one latent K/V head
            kv_BT1L = kv_BTL[:, :, None]
            out_BTHR = self.inner_attention(q_BTHL, kv_BT1L, kv_BT1L[..., :R], self.scale, ctx)
        else:  # packed training rows (under CP: this rank's queries, keys gathered by the CP hook)
            def expand_kv(kv_SL):
                k_nope, v = self.kv_b_proj(kv_SL[:, :R]).view(-1, H, self.nope_dim + self.v_dim).split(
                    [self.nope_dim, self.v_dim], dim=-1)
                return torch.cat([k_nope, kv_SL[:, None, R:].expand(-1, H, -1)], dim=-1), v

            q = LatentQuery(q_BTHL, R, self.index_source, w_uv, torch.cat([q_nope, q_rot], dim=-1), expand_kv,
                            invariant=self.batch_invariant, expand_out=self._expand_out)
            if index is not None:
                q.index_q_BTHD, q.index_w_BTH, q.topk, q.index_scale = index[0], index[1], self.indexer.topk, \
                    self.indexer.scale
            keys = index[2][:, :, None] if index is not None else kv_BTL.new_zeros(B, T, 1, 1)
            return self.sparse_attention(q, kv_BTL[:, :, None], keys, self.scale, ctx)
        return self._expand_out(out_BTHR, w_uv)


class DeepseekV3ForCausalLM(CausalLM):
    attention_cls = MLAttention
    hf_architecture = "DeepseekV3ForCausalLM"

    @staticmethod
    def rope_dim(args: ModelArgs) -> int:
        return args.qk_rope_head_dim
