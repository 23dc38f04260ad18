from typing import Literal

from rlcli.config.base import Config


class InferConfig(Config):
    """rl-infer: one inference server."""

    backend: Literal["native"] = "native"
    """Engine: native (pure torch, continuous batching, paged KV cache)."""

    host: str = "127.0.0.1"
    """Interface the server binds to; the registry advertises it to peers."""

    port: int = 0
    """TCP port of the request socket; 0 picks a free one."""

    max_num_seqs: int = 256
    """Most sequences decoded together in one engine step."""

    max_num_batched_tokens: int = 2048
    """Most prompt tokens prefilled in one engine step (longer prompts prefill in chunks)."""

    block_size: int = 16
    """Tokens per KV-cache block; prefix caching shares whole blocks."""

    kv_cache_memory_mb: int = 256
    """Memory for the KV cache; it sets the number of blocks."""

    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes with the same cache salt."""

    num_threads: int = 0
    """torch intra-op threads; 0 keeps torch's default."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"infer.block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("infer.max_num_seqs must be >= 1")
        if not 0 <= self.port < 65536:
            raise ValueError(f"infer.port must be in [0, 65535], got {self.port}")
