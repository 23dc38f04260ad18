"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 with DeepSeek Sparse Attention. Every layer
has a lightning indexer (:mod:`rlcli.models.indexer`, rope on half-split pairs) and
attends, in latent form, to the ``index_topk`` earlier tokens it scores highest
(:mod:`rlcli.ops.mla`). MLA always rotates interleaved pairs; the query LoRA is required."""

from rlcli.models.deepseek_v3 import DeepseekV3ForCausalLM


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    hf_architecture = "DeepseekV32ForCausalLM"
