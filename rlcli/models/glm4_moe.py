"""GLM-4.5 / GLM-4.6 (``glm4_moe``): grouped-query attention with q/k/v biases (the output
projection has none), optional per-head QK RMSNorm (``use_qk_norm``), RoPE on only the first
``partial_rotary_factor`` of each head (half-split pairs), and the DeepSeek-V3 MoE: sigmoid
routing with a selection-only bias, group-limited top-k, shared experts, the first
``first_k_dense_replace`` layers dense."""

from rlcli.models.config import ModelArgs
from rlcli.models.transformer import CausalLM


class Glm4MoeForCausalLM(CausalLM):
    hf_architecture = "Glm4MoeForCausalLM"

    @staticmethod
    def rope_dim(args: ModelArgs) -> int:
        return int(args.head_dim * args.partial_rotary_factor)
