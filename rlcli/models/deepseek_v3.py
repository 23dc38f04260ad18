"""DeepSeek-V3 family (DeepSeek-V3/R1, Kimi-K2): multi-head latent attention (MLA) and an
MoE with sigmoid routing, a selection-only score bias, group-limited top-k and shared
experts; the first ``first_k_dense_replace`` layers are dense.

MLA compresses keys and values into a ``kv_lora_rank`` latent plus one shared rotary key
of ``qk_rope_head_dim``; ``kv_b_proj`` expands the latent into per-head keys (no rope part)
and values. Here the expanded per-head K/V go to the attention backend, so the paged KV
cache holds expanded heads; caching the latent itself (the memory win MLA is built for)
belongs to the attention backend and comes with sparse attention (DSA).
"""

import torch
import torch.nn as nn

from rlcli.models.config import ModelArgs
from rlcli.models.layers import RMSNorm, RotaryEmbedding, yarn_mscale
from rlcli.models.transformer import CausalLM
from rlcli.ops.attention import ForwardContext


class MLAttention(nn.Module):
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

    def kv_spec(self) -> tuple[int, int, int]:
        return self.num_heads, self.qk_dim, self.v_dim

    def forward(self, x_BTD: torch.Tensor, rope: RotaryEmbedding, cos_sin, ctx: ForwardContext) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H = self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_nope, q_rot = q.view(B, T, H, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, H, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_rot = rope.apply(q_rot, *cos_sin)
        k_rot = rope.apply(k_rot.view(B, T, 1, self.rope_dim), *cos_sin).expand(B, T, H, self.rope_dim)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        out = ctx.attn(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(B, T, H * self.v_dim))


class DeepseekV3ForCausalLM(CausalLM):
    attention_cls = MLAttention
    hf_architecture = "DeepseekV3ForCausalLM"

    @staticmethod
    def rope_dim(args: ModelArgs) -> int:
        return args.qk_rope_head_dim
