"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5).

Its own small projections score every earlier token for every query: queries come from
the attention's query latent (``wq_b``), one key per token from the hidden state (``wk``,
then a LayerNorm), both rotated on their first ``qk_rope_head_dim`` features, and
per-head weights from the hidden state (``weights_proj``). It only chooses tokens
(:func:`rlcli.ops.mla.select_topk`); nothing differentiable flows through it, as in the
reference, so the LM loss gives its weights no gradient.
"""

import torch
import torch.nn as nn

from rlcli.models.config import ModelArgs
from rlcli.models.layers import RotaryEmbedding


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.interleave = args.index_rope_interleave
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.scale = self.head_dim ** -0.5

    @torch.no_grad()
    def forward(self, x_BTD: torch.Tensor, q_resid_BTR: torch.Tensor, rope: RotaryEmbedding, cos_sin):
        """(queries [B, T, Hi, Di], head weights [B, T, Hi] fp32, keys [B, T, Di])."""
        B, T, _ = x_BTD.shape
        q = self.wq_b(q_resid_BTR).view(B, T, self.n_heads, self.head_dim)
        q = rope.apply(q, *cos_sin, interleave=self.interleave)
        k = self.k_norm(self.wk(x_BTD)).view(B, T, 1, self.head_dim)
        k = rope.apply(k, *cos_sin, interleave=self.interleave)[:, :, 0]
        # The reference keeps weights_proj in fp32 (its input is cast up to it); an FP8 weight
        # (FP8 inference storage) takes the hidden state as it is.
        wdt = self.weights_proj.weight.dtype
        w = self.weights_proj(x_BTD if wdt.itemsize == 1 else x_BTD.to(wdt)).float() * self.n_heads ** -0.5
        return q, w, k
