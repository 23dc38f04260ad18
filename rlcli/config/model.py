from typing import Literal

from rlcli.config.base import Config


class ModelConfig(Config):
    """The policy model shared by rl-train and rl-infer."""

    path: str = ""
    """HF-layout model directory (config.json, safetensors, tokenizer). A directory with a
    config.json but no safetensors starts from random weights drawn with the recipe's seed."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype of the trainer and the native inference engine."""

    max_seq_len: int = 1024
    """Longest sequence (prompt + completion) in tokens that either side accepts."""

    def __post_init__(self) -> None:
        if self.max_seq_len < 8:
            raise ValueError(f"model.max_seq_len must be >= 8, got {self.max_seq_len}")
