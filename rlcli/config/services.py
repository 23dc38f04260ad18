import math
from typing import Literal, Union

import msgspec

from rlcli.config.base import Config


class WeightTransportBase(Config, tag_field="kind"):
    """How a new policy travels from the trainer's ranks to the servers (``sync.backend.kind``)."""


class FilesystemTransport(WeightTransportBase, tag="filesystem"):
    """The trainer writes RUN/weights/step_N (each rank its shard files) before its next step;
    servers read it layer by layer into their parameters."""


class AsyncFilesystemTransport(WeightTransportBase, tag="async_filesystem"):
    """As filesystem, but a background thread writes the snapshot while the next step trains;
    STABLE is marked only once the bytes are durable, and the next publish waits for it."""


class CollectiveTransport(WeightTransportBase, tag="collective"):
    """Bucketed broadcasts from the trainer's ranks to every server over standalone process
    groups (NCCL on GPU, gloo on CPU); only policy 0 is written to disk."""

    senders: int = 1
    """Trainer ranks that stage and send the weights: the buckets are dealt to them in
    contiguous runs of about equal bytes, so each holds about 1/senders of the model in its
    staging buffer (rank 0 alone holds all of it at 1). They are spread evenly over the
    trainer's ranks (rank k * world_size // senders): one per node when it equals the nodes."""

    bucket_bytes: int = 256 << 20
    """Bytes per broadcast: tensors smaller than this share buckets of at most this size, a
    larger one is a bucket alone. Large buckets reach the link's bandwidth; the native engine
    receives every bucket straight into its parameters whatever the size."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1024:
            raise ValueError(f"sync.backend.bucket_bytes must be >= 1024, got {self.bucket_bytes}")
        if self.senders < 1:
            raise ValueError(f"sync.backend.senders must be >= 1, got {self.senders}")


WeightTransport = Union[FilesystemTransport, AsyncFilesystemTransport, CollectiveTransport]


class SyncConfig(Config):
    """rl-sync: moves each new policy to every inference server."""

    backend: WeightTransport = msgspec.field(default_factory=AsyncFilesystemTransport)
    """Weight transport, chosen by ``kind``: async_filesystem (the default: the trainer's next step
    starts while the files are written), filesystem or collective."""

    host: str = "127.0.0.1"
    """Interface rl-sync's announcement socket binds to, and the address the collective transport's
    rendezvous store (which listens on every interface) is given as; 0.0.0.0 lets servers and
    trainer ranks on other hosts join, and peers are told this host's address."""

    keep_weights: int = 3
    """Keep this many newest weight versions on disk (never one a server still loads, nor policy 0
    before the trainer's first checkpoint)."""

    keep_weights_every: int = 0
    """Also keep, for good, every policy whose version is a multiple of this (HF-layout milestones
    to serve or evaluate later; filesystem transports, which write every version); 0: none."""

    ack_timeout_s: float = 120.0
    """A server that has not acknowledged a load in this long is skipped (logged, not waited
    for by PolicyUpdated) until it answers again, and so is one whose loads have failed for this
    long (filesystem transports; it is retried, at most this far apart, until one succeeds).
    Also the deadline of every collective op."""

    poll_interval_s: float = 0.5
    """How often the run directory is scanned when no announcement arrives."""

    def __post_init__(self) -> None:
        if not (self.ack_timeout_s > 0 and math.isfinite(self.ack_timeout_s)):
            raise ValueError(f"sync.ack_timeout_s must be > 0 and finite, got {self.ack_timeout_s}")
        if not (self.poll_interval_s > 0 and math.isfinite(self.poll_interval_s)):
            raise ValueError(f"sync.poll_interval_s must be > 0 and finite, got {self.poll_interval_s}")
        if self.keep_weights < 1:
            raise ValueError(f"sync.keep_weights (--keep-weights) must be >= 1, got {self.keep_weights}")
        if self.keep_weights_every < 0:
            raise ValueError(f"sync.keep_weights_every must be >= 0 (0: no milestones), got {self.keep_weights_every}")


class CacheBackendBase(Config, tag_field="name"):
    """Where rl-cache keeps blocks (``cache.backend.name``)."""

    @property
    def name(self) -> str:
        """The tag: "memory" or "mooncake"."""
        return type(self).__struct_config__.tag


class MemoryCacheBackend(CacheBackendBase, tag="memory"):
    """The embedded store: a RAM LRU, optionally over a checksummed disk tier; payloads move
    through /dev/shm on one host (inline over ZeroMQ from other hosts)."""

    disk_dir: str = ""
    """Directory of the disk tier that RAM evictions go to; empty keeps RAM only."""

    disk_capacity_mb: int = 8192
    """Byte capacity of the disk tier."""

    arena: bool = True
    """Keep the RAM tier in one shared-memory arena that same-host engines map (falls back to
    Python bytes, reached through copies, where /dev/shm lacks the room or this is false)."""

    def __post_init__(self) -> None:
        if self.disk_capacity_mb < 1:
            raise ValueError(f"cache.backend.disk_capacity_mb must be >= 1, got {self.disk_capacity_mb}")


class MooncakeCacheBackend(CacheBackendBase, tag="mooncake"):
    """Mooncake's distributed store (pip install 'rlcli[mooncake]'): rl-cache keeps the index and
    mounts cache.capacity_mb into the pool; payloads move through Mooncake's transfer engine."""

    master: str = ""
    """host:port of a running mooncake_master; empty: rl-cache serve starts one on cache.host."""

    metadata_server: str = ""
    """Transfer-engine metadata URL (http://host:port/metadata); empty: the started master's."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    """Transfer-engine protocol."""

    device_names: str = ""
    """RDMA devices (protocol rdma), comma-separated; empty lets Mooncake choose."""


CacheBackend = Union[MemoryCacheBackend, MooncakeCacheBackend]


class CacheConfig(Config):
    """rl-cache: the shared KV block store."""

    backend: CacheBackend = msgspec.field(default_factory=MemoryCacheBackend)
    """Store, chosen by ``name`` (rl-cache serve --backend): memory or mooncake."""

    host: str = "127.0.0.1"
    """Interface the store binds to (loopback unless set)."""

    port: int = 0
    """TCP port; 0 picks a free one."""

    metrics_interval_s: float = 10.0
    """Every this many seconds in which it was used, rl-cache appends one record to
    RUN/metrics/cache.jsonl: hits, misses and hit rate, blocks stored and evicted, bytes held.
    0 turns it off."""

    capacity_mb: int = 1024
    """Byte capacity of the RAM tier (the Mooncake segment with backend mooncake); least recently
    used blocks are evicted past it."""

    def __post_init__(self) -> None:
        if self.capacity_mb < 1:
            raise ValueError(f"cache.capacity_mb must be >= 1, got {self.capacity_mb}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"cache.port must be in [0, 65535], got {self.port}")
        if not self.metrics_interval_s >= 0:
            raise ValueError(f"cache.metrics_interval_s must be >= 0 (0 turns it off), got {self.metrics_interval_s}")


PROCESS_NAMES = ("cache", "infer", "sync", "train", "orchestrate")


class UpConfig(Config):
    """rl-orchestrate up: the local launcher."""

    processes: list[Literal["cache", "infer", "sync", "train", "orchestrate"]] = msgspec.field(
        default_factory=lambda: list(PROCESS_NAMES)
    )
    """Commands to launch as child processes."""

    num_infer: int = 1
    """rl-infer servers to launch."""

    num_prefill: int = 0
    """Of those, how many run --role prefill (the others --role decode, all with --kv-cache of the
    run's rl-cache, unless infer.kv_cache.endpoint names another); 0 keeps every server mixed."""

    plot: bool = True
    """Write RUN/reward.png at the end."""

    train_nproc_per_node: int = 1
    """rl-train ranks (rl-train --nproc-per-node); orchestrate.num_train_ranks must match its dp."""

    teacher: str = ""
    """A teacher model directory (HF layout with safetensors weights, the student's tokenizer): up serves it
    with an rl-infer of its own in RUN/teacher (this recipe's infer settings, model.max_seq_len + 64) and
    sets orchestrate.teacher.run_dir to it (on-policy distillation). Empty: none."""

    def __post_init__(self) -> None:
        if self.num_infer < 1:
            raise ValueError("up.num_infer must be >= 1")
        if self.train_nproc_per_node < 1:
            raise ValueError("up.train_nproc_per_node must be >= 1")
        if not 0 <= self.num_prefill < self.num_infer:
            raise ValueError(f"up.num_prefill must be in [0, up.num_infer - 1] (a decode server is needed), "
                             f"got {self.num_prefill}")
        missing = {"infer", "train", "orchestrate"} - set(self.processes)
        if missing:
            raise ValueError(f"up.processes must include {sorted(missing)}")
