"""Model architectures and Hugging Face checkpoint / tokenizer I/O. No distributed code."""

from rlcli.models.config import ARCHITECTURES, ModelArgs
from rlcli.models.hf_io import DTYPES, build_model, load_model, load_weights, save_model
from rlcli.models.transformer import CausalLM

__all__ = ["ARCHITECTURES", "ModelArgs", "CausalLM", "DTYPES", "build_model", "load_model", "load_weights",
           "save_model"]
