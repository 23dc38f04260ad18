"""Tiny random Hugging Face models of every architecture, shared by the model tests.

Each config is small enough to run in milliseconds but exercises the variant that could go
wrong: tied embeddings and llama3 RoPE scaling, biases, QK-norm, MoE with dense layers in
between, MLA with a query LoRA, group-limited routing, shared experts and YaRN. Every
parameter (norm weights, biases, the routing bias buffer too) is randomized so that a
mapping error (a transposed, swapped or skipped tensor) changes the logits.
"""

import torch
import transformers

from rlcli.ops.attention import ForwardContext, PagedAttention, PagedAttentionMetadata, RoutingContext

_COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128)

# name -> (HF config class, HF model class, config kwargs)
TINY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        _COMMON, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", dict(
        _COMMON, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_COMMON, head_dim=32, attention_bias=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _COMMON, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1])),
    "qwen3_moe_unnormed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _COMMON, head_dim=16, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _COMMON, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
    "deepseek_v3_no_q_lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _COMMON, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=2, n_shared_experts=2, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        _COMMON, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5, attention_bias=True,
        use_qk_norm=True, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5})),
    # DSA: index_topk below the test sequence lengths, so top-k really drops tokens.
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        _COMMON, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_topk=5, index_n_heads=8, index_head_dim=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "beta_fast": 32, "beta_slow": 1})),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        _COMMON, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, index_topk=6, index_n_heads=8, index_head_dim=24,
        indexer_types=["full", "shared", "full"])),
}
ARCHS = list(TINY_CONFIGS)
MOE_ARCHS = ["qwen3_moe", "qwen3_moe_unnormed", "deepseek_v3", "deepseek_v3_no_q_lora"]


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: matrices N(0, 0.1), norm weights 1 + N(0, 0.5), other vectors N(0, 0.5),
    and the DeepSeek routing bias N(0, 0.1) (it only changes which experts win)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() > 1:
            p.copy_(noise * 0.1)
        else:
            p.copy_(noise * 0.5 + (1.0 if name.endswith("norm.weight") else 0.0))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def make_hf_model(name: str, seed: int = 0):
    cfg_cls, model_cls, kwargs = TINY_CONFIGS[name]
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    randomize_(model, seed)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def random_ids(vocab_size: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, with NaN counted as infinitely far (so ``max()`` over a list cannot hide it)."""
    return (a - b).abs().nan_to_num(nan=float("inf")).max().item()


# ------------------------------------------------------------------------------ paged KV cache

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def make_caches(model, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE, fill: float | None = None):
    """Per layer the paged cache tensors ``[num_blocks, block_size, heads, dim]`` of
    ``model.kv_cache_spec()`` (K and V, or the MLA latent and DSA indexer keys), holding large
    random garbage (or ``fill``), so that attending to a slot this test never wrote shows up."""
    gen = torch.Generator().manual_seed(123)

    def garbage(*shape):
        return torch.full(shape, fill) if fill is not None else torch.randn(shape, generator=gen) * 100

    return [tuple(garbage(num_blocks, block_size, h, d) for h, d in layer) for layer in model.kv_cache_spec()]


def paged_step(model, caches, chunks, num_decode: int = 0, routing: RoutingContext | None = None) -> torch.Tensor:
    """One inference-engine step through the paged KV cache. ``chunks`` is a list of (new token
    ids [t], start position, block table), the first ``num_decode`` of them single decode tokens;
    returns logits [sum t, V] in chunk order."""
    ids, positions, slots, query_start, context_lens = [], [], [], [0], []
    max_blocks = max(len(table) for _, _, table in chunks)
    tables = torch.full((len(chunks), max_blocks), -1, dtype=torch.long)
    for i, (new_ids, start, table) in enumerate(chunks):
        pos = torch.arange(start, start + len(new_ids))
        ids.append(new_ids)
        positions.append(pos)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos.tolist()]
        query_start.append(query_start[-1] + len(new_ids))
        context_lens.append(start + len(new_ids))
        tables[i, :len(table)] = torch.tensor(table)
    dev = caches[0][0].device  # the model's (the tests on CUDA move it and the caches there)
    meta = PagedAttentionMetadata(slot_mapping=torch.tensor(slots, device=dev), query_start=query_start,
                                  context_lens=context_lens, block_tables=tables.to(dev), block_size=BLOCK_SIZE,
                                  num_decode=num_decode)
    ctx = ForwardContext(attn=PagedAttention(caches, meta), routing=routing)
    return model(torch.cat(ids)[None].to(dev), torch.cat(positions)[None].to(dev), ctx)[0]


def scattered_blocks(seed: int, n: int) -> list[int]:
    """A scattered block table: blocks need not be contiguous or ordered."""
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:n].tolist()
