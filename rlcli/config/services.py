from typing import Literal

import msgspec

from rlcli.config.base import Config


class SyncConfig(Config):
    """rl-sync: moves each new policy to every inference server."""

    backend: Literal["filesystem"] = "filesystem"
    """Weight transport: filesystem (servers read RUN/weights/step_N)."""

    keep_weights: int = 3
    """Keep this many newest weight versions on disk (never one a server still loads)."""

    ack_timeout_s: float = 120.0
    """A server that has not acknowledged a load in this long is reported and skipped."""

    poll_interval_s: float = 0.5
    """How often the run directory is scanned when no announcement arrives."""


class CacheConfig(Config):
    """rl-cache: the shared KV block store."""

    backend: Literal["memory"] = "memory"
    """Store: memory (embedded, byte-bounded LRU)."""

    host: str = "127.0.0.1"
    """Interface the store binds to."""

    port: int = 0
    """TCP port; 0 picks a free one."""

    capacity_mb: int = 1024
    """Byte capacity of the store; least recently used blocks are evicted past it."""


PROCESS_NAMES = ("cache", "infer", "sync", "train", "orchestrate")


class UpConfig(Config):
    """rl-orchestrate up: the local launcher."""

    processes: list[Literal["cache", "infer", "sync", "train", "orchestrate"]] = msgspec.field(
        default_factory=lambda: list(PROCESS_NAMES)
    )
    """Commands to launch as child processes."""

    num_infer: int = 1
    """rl-infer servers to launch."""

    plot: bool = True
    """Write RUN/reward.png at the end."""

    train_nproc_per_node: int = 1
    """rl-train ranks (rl-train --nproc-per-node); orchestrate.num_train_ranks must match its dp."""

    def __post_init__(self) -> None:
        if self.num_infer < 1:
            raise ValueError("up.num_infer must be >= 1")
        if self.train_nproc_per_node < 1:
            raise ValueError("up.train_nproc_per_node must be >= 1")
        missing = {"infer", "train", "orchestrate"} - set(self.processes)
        if missing:
            raise ValueError(f"up.processes must include {sorted(missing)}")
