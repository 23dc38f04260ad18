"""GLM-5 family (``glm_moe_dsa``): DeepSeek-V3.2's architecture with two differences: the
indexer rotates interleaved pairs, and only the layers marked ``"full"`` in
``indexer_types`` run an indexer; a ``"shared"`` layer attends to the tokens chosen by the
last full layer before it (cross-layer top-k sharing)."""

from rlcli.models.deepseek_v3 import DeepseekV3ForCausalLM


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    hf_architecture = "GlmMoeDsaForCausalLM"
