"""Layers shared by every architecture: RMSNorm, rotary embeddings, GQA attention, SwiGLU.

Numerics follow the reference implementations (``transformers``) so that our logits
match theirs: RMSNorm in fp32 then cast, rotary tables in fp32 cast to the activation
dtype, softmax inside SDPA.
"""

import math

import torch
import torch.nn as nn

from rlcli.models.config import ModelArgs
from rlcli.ops.attention import ForwardContext, InnerAttention
from rlcli.ops.swiglu import swiglu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back before the weight (transformers' order)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


# ------------------------------------------------------------------------------ rotary


def rope_inv_freq(dim: int, theta: float, scaling: dict | None, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin attention factor for a RoPE variant."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3, yarn)")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / orig
    mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                            if mscale and mscale_all else yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions; ``interleave`` rotates (even, odd) pairs (DeepSeek).

    The frequencies stay fp32 in a model of any dtype (``fp32_buffers``; only the tables are cast):
    rounded to bf16 they are up to 2^-9 off, an angle error that grows with the position (radians
    by 100k tokens), and a trainer holding fp32 masters (FSDP2 casts parameters, not buffers)
    would rotate by other angles than a bf16 engine."""

    fp32_buffers = ("inv_freq",)

    def __init__(self, dim: int, theta: float, scaling: dict | None, max_position_embeddings: int,
                 interleave: bool = False):
        super().__init__()
        self.dim, self.theta, self.scaling, self.max_pos = dim, theta, scaling, max_position_embeddings
        self.interleave = interleave
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.attention_factor = 1.0

    def init_buffers(self) -> None:
        inv_freq, self.attention_factor = rope_inv_freq(self.dim, self.theta, self.scaling, self.max_pos)
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq.to(self.inv_freq.device))

    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids_BT.float()[..., None] * self.inv_freq.float()  # [B, T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x_BTHD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor,
              interleave: bool | None = None) -> torch.Tensor:
        """Rotate the first ``dim`` features of every head (all of them unless the rotary is
        partial); ``interleave`` overrides the table's pair layout (the DSA indexer's own)."""
        cos, sin = cos_BTD[:, :, None], sin_BTD[:, :, None]
        rot = cos.shape[-1]
        if x_BTHD.shape[-1] > rot:
            x_rot, x_pass = x_BTHD.split([rot, x_BTHD.shape[-1] - rot], dim=-1)
            return torch.cat([self.apply(x_rot, cos_BTD, sin_BTD, interleave), x_pass], dim=-1)
        if self.interleave if interleave is None else interleave:
            half = rot // 2
            cos, sin = cos[..., :half], sin[..., :half]
            x1, x2 = x_BTHD[..., 0::2], x_BTHD[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x1, x2 = x_BTHD.chunk(2, dim=-1)
        return x_BTHD * cos + torch.cat((-x2, x1), dim=-1) * sin


# ------------------------------------------------------------------------------ attention


class Attention(nn.Module):
    """Grouped-query attention with optional per-head QK RMSNorm (Qwen3) and biases."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        D, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=args.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.scale = self.head_dim ** -0.5
        self.inner_attention = InnerAttention(layer_idx)

    def kv_spec(self) -> tuple[tuple[int, int], ...]:
        """(heads, dim) of this layer's paged K and V caches."""
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    def forward(self, x_BTD: torch.Tensor, rope: RotaryEmbedding, cos_sin, ctx: ForwardContext) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q = self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, *cos_sin), rope.apply(k, *cos_sin)
        out = self.inner_attention(q, k, v, self.scale, ctx)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); the gate in one kernel each way on CUDA
    (:func:`rlcli.ops.swiglu.swiglu`)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
