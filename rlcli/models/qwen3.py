"""Qwen3 dense: Llama's block with per-head RMSNorm on queries and keys before RoPE
(``ModelArgs.qk_norm``) and an explicit ``head_dim``."""

from rlcli.models.transformer import CausalLM


class Qwen3ForCausalLM(CausalLM):
    hf_architecture = "Qwen3ForCausalLM"
