"""Helpers for the shared-prompt tests: tiny dense and MoE models, groups of samples (with R3
routes), and the trainer's own accumulation (rlcli.train.step) over a packed step."""

import json
from pathlib import Path

import numpy as np
import torch

from rlcli.config.train import LossConfig
from rlcli.models import ModelArgs, build_model, save_model
from rlcli.parallel.dims import ParallelDims
from rlcli.protocol import WireTensor
from rlcli.protocol.batch import Sample, build_micro_batch, pack_samples
from rlcli.train.loss import LOSSES, token_logprobs
from rlcli.train.step import accumulate

COMMON = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6)
CONFIGS = {
    "dense": dict(COMMON, model_type="llama", tie_word_embeddings=True),
    "moe": dict(COMMON, model_type="qwen3_moe", tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
                moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[]),
    # DeepSeek-V3.2: MLA with DSA, each query attending to its indexer's top 4 tokens (fewer than
    # most prompts hold, so the selection decides the function), and MoE routed by R3.
    "dsa": dict(COMMON, model_type="deepseek_v32", tie_word_embeddings=False, num_key_value_heads=4,
                q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                index_topk=4, index_n_heads=4, index_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1),
}
# Sequence masking on: the loss needs each completion's own sequence id in a shared row too.
LCFG = LossConfig(entropy_coef=0.01, sequence_mask_high=1.02)


def make_model(hf: dict, seed: int, directory: Path | None = None) -> torch.nn.Module:
    model = build_model(ModelArgs.from_hf(hf))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.2)
                    + (1.0 if name.endswith("norm.weight") else 0.0))
    if directory is not None:
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(hf))
        save_model(model, directory)
    return model


def make_samples(model, seed: int, prompts=(9, 5, 14, 7), group_sizes=(4, 3, 5, 2), r3: bool = False,
                 common: int = 0) -> list[Sample]:
    """Groups of completions, siblings adjacent. Inference logprobs are the model's own, perturbed
    (ratios stay near 1); with ``r3`` random routes, the prompt's shared by the group (as the
    engine's n-way fork records them). ``common``: every prompt begins with the same tokens
    (and routes) for that many tokens, then differs at the next one."""
    rng = np.random.default_rng(seed)
    args = model.args
    V = args.vocab_size
    L, k = len(args.moe_layers), args.num_experts_per_tok
    head = rng.integers(0, V, common).tolist()
    head_routes = np.stack([rng.permutation(args.num_experts)[:k] for _ in range(common * L)]).reshape(
        common, L, k) if r3 and common else None
    out = []
    for j, (p, g) in enumerate(zip(prompts, group_sizes)):
        prompt = rng.integers(0, V, p).tolist()
        if common:
            prompt[:common + 1] = head + [(j * 7 + 1) % V]  # alike up to common, different after
        if r3:
            prompt_routes = np.stack([rng.permutation(args.num_experts)[:k] for _ in range(p * L)]).reshape(p, L, k)
            if common:
                prompt_routes[:common] = head_routes
        for _ in range(g):
            c = int(rng.integers(1, 9))
            ids = prompt + rng.integers(0, V, c).tolist()
            with torch.no_grad():
                lp, _ = token_logprobs(model(torch.tensor([ids])), torch.tensor([ids]), 1.0)
            routes = None
            if r3:
                tail = [rng.permutation(args.num_experts)[:k] for _ in range((c - 1) * L)]
                r = np.concatenate([prompt_routes, np.asarray(tail, dtype=np.int64).reshape(c - 1, L, k)])
                r = r.astype(np.int16)
                routes = WireTensor.from_numpy(r)
            out.append(Sample(token_ids=ids, num_prompt_tokens=p, advantage=float(rng.normal()),
                              logprobs=(lp[0, p:] + torch.from_numpy(rng.normal(0, 0.05, c))).tolist(),
                              versions=[0] * c, routed_experts=routes))
    return out


def micro_batches(samples: list[Sample], share: bool, capacity: int = 64, num_ranks: int = 1):
    per_rank, _ = pack_samples(samples, capacity, num_ranks, share)
    return [[build_micro_batch([samples[i] for i in row], 1.0, share_prompts=share) for row in rows]
            for rows in per_rank]


def train_step(model, mbs, r3: bool = False):
    """The trainer's accumulation (one process): (loss sum, normalizer, {name: grad})."""
    model.zero_grad(set_to_none=True)
    dims = ParallelDims(dp=1, cp=1, ep=1, world_size=1)
    totals, normalizer = accumulate(model, mbs, dims, torch.device("cpu"), LOSSES["icepop"], LCFG, chunk=7, r3=r3)
    # (A DSA indexer gets no gradient from the loss: its top-k is not differentiable.)
    return totals, normalizer, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
