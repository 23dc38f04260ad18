"""Qwen3-MoE: Qwen3 attention; sparse layers route each token to ``num_experts_per_tok`` of
``num_experts`` SwiGLU experts by softmax score (optionally renormalized over the top-k);
``mlp_only_layers`` / ``decoder_sparse_step`` keep some layers dense."""

from rlcli.models.transformer import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    hf_architecture = "Qwen3MoeForCausalLM"
