"""The decoder-only transformer every architecture instantiates.

Architecture only: no distributed code, no quantization. FSDP2 / EP / CP / FP8 are
applied from outside (``rlcli.parallel``). Module names follow the Hugging Face layout
(``model.layers.{i}.self_attn.q_proj``...) so checkpoints map one to one, except MoE
experts, which are stacked (see :mod:`rlcli.models.moe`).

Build on the meta device, then materialize::

    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device); model.init_buffers(); model.init_weights(seed)  # or load
"""

from typing import ClassVar

import torch
import torch.nn as nn

from rlcli.models.config import ModelArgs
from rlcli.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from rlcli.models.moe import MoE
from rlcli.ops.attention import ForwardContext, PackedCausalAttention


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, attention_cls: type[nn.Module]):
        super().__init__()
        self.self_attn = attention_cls(args, layer_idx)
        if layer_idx in args.moe_layers:
            self.mlp = MoE(args, args.moe_layers.index(layer_idx))
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x_BTD, rope, cos_sin, ctx: ForwardContext) -> torch.Tensor:
        h = x_BTD + self.self_attn(self.input_layernorm(x_BTD), rope, cos_sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx)


class TransformerModel(nn.Module):
    def __init__(self, args: ModelArgs, attention_cls: type[nn.Module], rope_dim: int, rope_interleave: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, attention_cls) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(rope_dim, args.rope_theta, args.rope_scaling,
                                          args.max_position_embeddings, rope_interleave)

    def forward(self, input_ids_BT, position_ids_BT, ctx: ForwardContext) -> torch.Tensor:
        h = self.embed_tokens(input_ids_BT)
        cos_sin = self.rotary_emb(position_ids_BT, h.dtype)
        for layer in self.layers:
            h = layer(h, self.rotary_emb, cos_sin, ctx)
        return self.norm(h)


class CausalLM(nn.Module):
    """Base of every architecture; subclasses choose the attention module."""

    attention_cls: ClassVar[type[nn.Module]] = Attention
    hf_architecture: ClassVar[str] = ""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = TransformerModel(args, self.attention_cls, self.rope_dim(args), args.rope_interleave)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def rope_dim(args: ModelArgs) -> int:
        return args.head_dim

    def hidden_states(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor | None = None,
                      ctx: ForwardContext | None = None) -> torch.Tensor:
        """Final normed hidden states [B, T, D] (logits are ``lm_head`` of these)."""
        if position_ids_BT is None:
            T = input_ids_BT.shape[1]
            position_ids_BT = torch.arange(T, device=input_ids_BT.device).expand_as(input_ids_BT)
        if ctx is None:
            ctx = ForwardContext(attn=PackedCausalAttention(position_ids_BT))
        if ctx.position_ids is None:
            ctx.position_ids = position_ids_BT
        return self.model(input_ids_BT, position_ids_BT, ctx)

    def forward(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor | None = None,
                ctx: ForwardContext | None = None) -> torch.Tensor:
        """Logits [B, T, V]. Without ``ctx``, rows are causal packed sequences split at position 0."""
        return self.lm_head(self.hidden_states(input_ids_BT, position_ids_BT, ctx))

    def kv_cache_spec(self) -> list[tuple[tuple[int, int], ...]]:
        """Per layer, (heads, dim) of each paged cache tensor: (K, V) for GQA, (latent + rope key,)
        for MLA, plus the indexer keys for a DSA layer."""
        return [layer.self_attn.kv_spec() for layer in self.model.layers]

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (rotary tables); call after ``to_empty``."""
        self.model.rotary_emb.init_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init (tiny models built from a config): N(0, std) matrices, unit norms,
        zero biases, output projections scaled by 1/sqrt(2 * layers)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        out_std = std / (2 * self.args.num_hidden_layers) ** 0.5
        for name, p in self.named_parameters():
            if p.dim() == 1:
                (p.fill_(1.0) if name.endswith("norm.weight") else p.zero_())
                continue
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "w_down")) else std
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)
        for buf_name, buf in self.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.zero_()
        self.tie_weights()
