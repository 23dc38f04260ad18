"""Environment configs: a tagged union on ``env.name``, one struct per environment."""

from typing import Literal, Union

from rlcli.config.base import Config


class EnvBase(Config, tag_field="name"):
    use_chat_template: bool = False
    """Render each prompt through the tokenizer's chat template as a user message."""

    system_prompt: str = ""
    """System message placed before the prompt when use_chat_template is set."""


class ReverseEnvConfig(EnvBase, tag="reverse"):
    """Reverse a short string; reward is the similarity of the answer to the reversal."""

    min_len: int = 3
    """Shortest string to reverse, in characters."""

    max_len: int = 8
    """Longest string to reverse, in characters."""

    alphabet: str = "abcdefghijklmnopqrstuvwxyz"
    """Characters the strings are drawn from."""

    reward: Literal["similarity", "exact"] = "similarity"
    """similarity: 1 - normalized edit distance, in [0, 1]; exact: 1 if exactly right else 0."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"env.min_len ({self.min_len}) must be >= 1 and <= env.max_len ({self.max_len})"
            )
        if not self.alphabet:
            raise ValueError("env.alphabet must not be empty")


class LongTailEnvConfig(EnvBase, tag="longtail"):
    """A throughput workload: each task asks for a completion whose length is drawn from a
    long-tailed (log-normal) distribution, generated with EOS ignored. Reward is a cheap
    function of the tokens. Used by bench/async_vs_sync.py."""

    prompt_len: int = 16
    """Prompt length in characters."""

    median_tokens: int = 24
    """Median completion length in tokens."""

    sigma: float = 1.0
    """Log-normal shape: larger means a longer tail."""

    max_tokens: int = 512
    """Completion lengths are clipped to this many tokens."""

    def __post_init__(self) -> None:
        if self.median_tokens < 1 or self.max_tokens < self.median_tokens:
            raise ValueError("env.median_tokens must be >= 1 and <= env.max_tokens")
        if self.sigma < 0:
            raise ValueError(f"env.sigma must be >= 0, got {self.sigma}")


EnvConfig = Union[ReverseEnvConfig, LongTailEnvConfig]
