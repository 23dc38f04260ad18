"""Llama 3 (and SmolLM2, Llama 2, Mistral-style dense models): GQA attention, SwiGLU, RMSNorm,
RoPE with optional llama3 / linear / yarn scaling, optionally tied embeddings."""

from rlcli.models.transformer import CausalLM


class LlamaForCausalLM(CausalLM):
    hf_architecture = "LlamaForCausalLM"
