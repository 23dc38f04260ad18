"""Every message that crosses a process boundary.

Messages are msgspec structs encoded as msgpack, tagged by ``type`` and carrying the
protocol version they were written with. A receiver first reads the small
:class:`Envelope` (type, protocol, request_id) so that a message from another version
or of an unknown type still gets an error reply naming its request.

Tensors travel as :class:`WireTensor`: raw little-endian bytes + dtype name + shape.
"""

import math
from typing import Optional, Union

import msgspec
import numpy as np

PROTOCOL_VERSION = 1

__all__ = [
    "PROTOCOL_VERSION", "WireTensor", "Envelope", "Message", "SamplingParams", "GenerateRequest",
    "Completion", "GenerateResponse", "TensorSpec", "FsWeights", "NcclWeights", "WeightsRef", "LoadWeights", "WeightsLoaded", "HealthRequest",
    "HealthResponse", "ErrorReply", "WeightsPublished", "PolicyUpdated", "BatchWritten", "CachePut", "CacheGet",
    "CacheExists", "CacheStatsRequest", "CacheReply", "CacheGetReply", "CacheExistsReply",
    "CacheStats", "BlockMeta", "CacheList", "CacheListReply", "CachePrune", "CachePruneReply", "CacheEntry",
    "CacheReserve", "CacheReserveReply", "CacheRelease",
    "Shutdown", "AbortRequests", "AnyMessage", "encode", "decode", "decode_envelope",
]


WIRE_DTYPES = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
               "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
"""Tensor dtypes that travel, with their item sizes in bytes."""


class WireTensor(msgspec.Struct, array_like=True):
    """A tensor as bytes. ``dtype`` is a numpy dtype name ("float32", "int32", "uint8", ...);
    bfloat16 travels as its uint16 bit pattern with dtype "bfloat16"."""

    data: bytes
    dtype: str
    shape: list[int]

    def __post_init__(self) -> None:
        # Runs on decode too: a tensor whose bytes do not match its dtype and shape is refused
        # at the socket (the receiver gets an ErrorReply), never reshaped into garbage later.
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"unsupported tensor dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative tensor dimension in shape {self.shape}")
        expected = WIRE_DTYPES[self.dtype] * math.prod(self.shape)
        if len(self.data) != expected:
            raise ValueError(f"tensor of dtype {self.dtype} and shape {self.shape} needs {expected} bytes, "
                             f"got {len(self.data)}")

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "WireTensor":
        array = np.ascontiguousarray(array)
        return cls(array.tobytes(), array.dtype.name, list(array.shape))

    def numpy(self) -> np.ndarray:
        dtype = np.uint16 if self.dtype == "bfloat16" else np.dtype(self.dtype)
        return np.frombuffer(self.data, dtype=dtype).reshape(self.shape)


class Envelope(msgspec.Struct):
    """The fields every message has; decoded first, before the full schema."""

    type: str
    protocol: int = 0
    request_id: str = ""


class Message(msgspec.Struct, tag_field="type", kw_only=True):
    protocol: int = PROTOCOL_VERSION
    """Protocol version the sender speaks."""


# ---------------------------------------------------------------- rl-infer


class SamplingParams(msgspec.Struct, kw_only=True):
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy. Logprobs are of the temperature-scaled distribution."""
    top_p: float = 1.0
    """Nucleus mass; logprobs are of the truncated, renormalized distribution sampled from."""
    max_tokens: int = 32
    """Most tokens to generate."""
    n: int = 1
    """Completions for this prompt; they share the prompt's KV blocks."""
    stop_token_ids: list[int] = []
    """Tokens that end a completion (kept in the output); the tokenizer's EOS is added by the server."""
    ignore_eos: bool = False
    """Generate exactly max_tokens tokens."""
    seed: Optional[int] = None
    """Per-request RNG seed; None draws from the server's generator."""
    return_routing: bool = False
    """Return the experts each token was routed to (MoE models; R3 replay)."""
    prompt_logprobs: int = -1
    """Also return the logprob of each prompt token from this index on (>= 1), each given the tokens
    before it, of the temperature-scaled distribution (temperature 0 counts as 1; no top-p; vLLM:
    temperature 1 only): a teacher scoring a student's completion (orchestrate.teacher). -1: none."""

    def __post_init__(self) -> None:
        # Checked on decode, so every engine sees only sane values (NaN or negative temperatures
        # would otherwise sample garbage without an error).
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"sampling.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1 or self.n < 1:
            raise ValueError("sampling.max_tokens and sampling.n must be >= 1")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"sampling.seed must be in [0, 2**63), got {self.seed}")
        if self.prompt_logprobs == 0 or self.prompt_logprobs < -1:
            raise ValueError(f"sampling.prompt_logprobs must be >= 1 (the first prompt token scored) or -1 (none), "
                             f"got {self.prompt_logprobs}")


class GenerateRequest(Message, tag="generate", kw_only=True):
    request_id: str
    """Caller-chosen id echoed in the response."""
    prompt_ids: list[int]
    """Prompt token ids."""
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    """Sampling parameters."""
    cache_salt: str = ""
    """Prefix-cache namespace (the orchestrator sends the policy version at dispatch): blocks
    are shared only between requests with the same salt. The engine also keys blocks by the
    weights version that computed them, so KV of other weights is never reused, whatever the salt."""


class Completion(msgspec.Struct, kw_only=True):
    token_ids: list[int]
    """Generated tokens (the stop token included)."""
    logprobs: list[float]
    """Log-probability of each generated token under the distribution it was sampled from
    (temperature-scaled; top-p truncated and renormalized)."""
    versions: list[int]
    """Policy version that produced each token (weights can change mid-completion)."""
    finish_reason: str
    """'stop' (stop token), 'length' (max_tokens or context), or 'abort'."""
    routed_experts: Optional[WireTensor] = None
    """uint8/int16 [prompt + generated - 1, num_moe_layers, top_k] expert ids, if requested."""


class GenerateResponse(Message, tag="generate_response", kw_only=True):
    request_id: str
    """Id of the request answered."""
    completions: list[Completion]
    """n completions."""
    num_prompt_tokens: int
    """Prompt length."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    prompt_logprobs: list[float] = []
    """With ``sampling.prompt_logprobs = k``: the logprob of each of ``prompt_ids[k:]``."""


class TensorSpec(msgspec.Struct, array_like=True):
    """One tensor of a collective weight transfer, in the order it is broadcast."""

    name: str
    """Parameter name in the HF checkpoint layout (the engine maps it to its own)."""
    dtype: str
    """torch dtype name without the prefix ("bfloat16", "float8_e4m3fn", ...)."""
    shape: list[int]
    """Full (unsharded) shape."""


class FsWeights(msgspec.Struct, tag="fs", kw_only=True):
    """Weights on the shared filesystem: an HF-layout safetensors directory with a STABLE marker."""

    path: str
    """The directory to load."""


class NcclWeights(msgspec.Struct, tag="nccl", kw_only=True):
    """Weights that arrive over a collective group (NCCL on GPU, gloo on CPU): the sender
    broadcasts ``tensors`` in order, in buckets of at most ``bucket_bytes``."""

    group: str
    """Rendezvous name of the weight-transfer group (rl-sync hands it out)."""
    tensors: list[TensorSpec]
    """Every tensor of the update, in broadcast order."""
    bucket_bytes: int = 0
    """Largest bucket the sender broadcasts at once; 0 sends tensor by tensor."""
    store: str = ""
    """host:port of rl-sync's rendezvous store the group is built from."""
    rank: int = 0
    """The server's rank in the group (the trainer's sending rank is 0); a server with several receivers
    (vLLM's tensor-parallel workers) gives them ``rank``, ``rank + 1``, ... in worker order."""
    world_size: int = 0
    """Members of the group: the trainer plus every receiver of every server of this generation."""
    senders: int = 1
    """Trainer ranks that send, each over a group of its own with the same members and ranks
    (``rlcli.transport.collective.sender_group``); bucket b comes from sender ``plan_owners(...)[b]``."""
    timeout_s: float = 120.0
    """Deadline of each collective op; a missed one fails the load instead of hanging it."""


WeightsRef = Union[FsWeights, NcclWeights]


class LoadWeights(Message, tag="load_weights", kw_only=True):
    request_id: str
    """Caller-chosen id."""
    version: int
    """Policy version these weights are (the trainer step that wrote them)."""
    weights: WeightsRef
    """Where the weights come from: a directory, or a collective transfer."""


class WeightsLoaded(Message, tag="weights_loaded", kw_only=True):
    request_id: str
    """Id of the LoadWeights answered."""
    version: int
    """Version now serving."""
    load_time_s: float = 0.0
    """Seconds spent reading and swapping the weights."""


class HealthRequest(Message, tag="health", kw_only=True):
    request_id: str = ""
    """Caller-chosen id."""
    request_ids: list[str] = []
    """Generation requests the caller has sent this server and awaits; the answer's ``unknown``
    lists those the server does not hold (lost on the way, or dropped without a reply)."""


class HealthResponse(Message, tag="health_response", kw_only=True):
    request_id: str = ""
    """Id of the request answered."""
    role: str = ""
    """Command that answered."""
    version: int = -1
    """Policy version being served (rl-infer)."""
    infer_role: str = ""
    """rl-infer's part in split serving: mixed, prefill or decode (``infer.role``)."""
    num_running: int = 0
    """Sequences decoding."""
    num_waiting: int = 0
    """Requests queued."""
    stats: dict[str, float] = {}
    """Counters (tokens generated, prefix-cache hit rate, ...)."""
    unknown: list[str] = []
    """Of the request's ``request_ids``, those this server holds no request for."""


class ErrorReply(Message, tag="error", kw_only=True):
    request_id: str = ""
    """Id of the request that failed, when it could be read."""
    message: str
    """What was wrong with it."""


class AbortRequests(Message, tag="abort", kw_only=True):
    request_ids: list[str]
    """Requests to stop and forget (their results can no longer be used); no reply is sent."""
    prefix: str = ""
    """Also stop every request whose id starts with this (empty: none)..."""
    except_prefix: str = ""
    """...unless it starts with this: a restarted client ends its predecessor's requests, not its own."""


class Shutdown(Message, tag="shutdown", kw_only=True):
    request_id: str = ""
    """Caller-chosen id; the server replies with HealthResponse, then exits."""


# ---------------------------------------------------------------- announcements (PUB/SUB)


class WeightsPublished(Message, tag="weights_published", kw_only=True):
    step: int
    """Trainer step whose weights are now STABLE in RUN/weights/step_<step>."""
    path: str
    """That directory ("" for a collective update: the weights stay staged in the trainer)."""
    timing: dict[str, float] = {}
    """Seconds the trainer spent: gather_s (collecting the tensors), write_s (files written)."""


class PolicyUpdated(Message, tag="policy_updated", kw_only=True):
    version: int
    """Every live rl-infer server now serves this version (new requests use it as salt)."""


class BatchWritten(Message, tag="batch_written", kw_only=True):
    step: int
    """RUN/rollouts/step_<step> is STABLE: the trainer waiting for it may read it now."""


# ---------------------------------------------------------------- rl-cache


class BlockMeta(msgspec.Struct, kw_only=True):
    """Layout of one KV block: a store refuses a block whose bytes do not match it, and
    answers a get whose requester has another layout with a miss."""

    fingerprint: str
    """Model fingerprint (architecture, KV layout, block size); blocks of other models never match."""
    dtype: str
    """Element dtype of the payload (a :data:`WIRE_DTYPES` name)."""
    shape: list[int]
    """Shape of one block's payload."""

    def __post_init__(self) -> None:
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"unsupported block dtype {self.dtype!r}")
        if not self.shape or any(d < 1 for d in self.shape) or math.prod(self.shape) > 1 << 34:
            raise ValueError(f"invalid block shape {self.shape}")
        if len(self.fingerprint) > 256:
            raise ValueError("block fingerprint longer than 256 characters")

    @property
    def nbytes(self) -> int:
        """Bytes of one block."""
        return WIRE_DTYPES[self.dtype] * math.prod(self.shape)


class CachePut(Message, tag="cache_put", kw_only=True):
    request_id: str = ""
    """Caller-chosen id."""
    keys: list[bytes]
    """Block keys (content hashes, salted)."""
    values: list[bytes] = msgspec.field(default_factory=list)
    """Block payloads, one per key (empty when they travel by ``shm`` or ``mooncake``)."""
    meta: Optional[BlockMeta] = None
    """Layout of every block of this put; a payload of another size is refused."""
    shm: str = ""
    """Name of a file in /dev/shm holding the payloads back to back (same host only)."""
    mooncake: bool = False
    """The payloads are already in the store's Mooncake pool under their keys; record them."""
    lease: int = 0
    """Commit of a :class:`CacheReserve`: the payloads of ``keys`` (those it reserved) are in its arena slots."""


class CacheGet(Message, tag="cache_get", kw_only=True):
    request_id: str = ""
    """Caller-chosen id."""
    keys: list[bytes]
    """Block keys to read."""
    meta: Optional[BlockMeta] = None
    """The requester's block layout: a block stored with another layout is a miss."""
    prefix: bool = False
    """Stop at the first miss: answer the longest run of leading keys held."""
    transfer: str = ""
    """Where the found payloads go: "" inline in the reply, "shm" a /dev/shm file, "arena"
    nowhere (they stay in the store's shared arena, leased to the requester, who reads the slots
    the reply names and sends :class:`CacheRelease`), "mooncake" nowhere (the requester reads them
    from the Mooncake pool; the reply says which exist)."""
    into: str = ""
    """With transfer "shm": the requester's own /dev/shm file (at least as large as the
    payloads asked for) to write the found ones into, from its start, instead of a new file."""


class CacheExists(Message, tag="cache_exists", kw_only=True):
    request_id: str = ""
    """Caller-chosen id."""
    keys: list[bytes]
    """Block keys to test."""


class CacheStatsRequest(Message, tag="cache_stats", kw_only=True):
    request_id: str = ""
    """Caller-chosen id."""


class CacheList(Message, tag="cache_list", kw_only=True):
    request_id: str = ""
    """Caller-chosen id."""
    limit: int = 1000
    """Most entries to return, most recently used first."""


class CachePrune(Message, tag="cache_prune", kw_only=True):
    request_id: str = ""
    """Caller-chosen id."""
    fingerprint: str = ""
    """Remove only blocks of this model fingerprint; empty removes every block."""
    tier: str = ""
    """Remove only from this tier ("ram" or "disk"); empty: every tier."""


class CacheReply(Message, tag="cache_reply", kw_only=True):
    request_id: str = ""
    """Id of the put answered."""
    num_stored: int = 0
    """Blocks stored (a block larger than the capacity, or not matching ``meta``, is refused)."""


class CacheGetReply(Message, tag="cache_get_reply", kw_only=True):
    request_id: str = ""
    """Id of the get answered."""
    values: list[Optional[bytes]] = msgspec.field(default_factory=list)
    """Payload per key; None for a miss (empty unless the transfer is inline)."""
    found: list[bool] = msgspec.field(default_factory=list)
    """Presence per key (every transfer)."""
    shm: str = ""
    """With transfer "shm": the /dev/shm file holding the found payloads back to back, in key
    order; the requester deletes it."""
    arena: str = ""
    """With transfer "arena": the /dev/shm file of the store's arena."""
    offsets: list[int] = msgspec.field(default_factory=list)
    """With transfer "arena": the byte offset in the arena of each found block, in key order."""
    lease: int = 0
    """With transfer "arena": the lease holding those slots (0: none, nothing was found)."""
    lease_s: float = 0.0
    """Seconds after which the store may reuse leased slots unreleased."""


class CacheReserve(Message, tag="cache_reserve", kw_only=True):
    request_id: str = ""
    """Caller-chosen id."""
    keys: list[bytes]
    """Keys of the blocks the requester will write into the arena."""
    meta: BlockMeta
    """Layout of every block (its size is the slot size)."""


class CacheReserveReply(Message, tag="cache_reserve_reply", kw_only=True):
    request_id: str = ""
    """Id of the reservation answered."""
    arena: str
    """The /dev/shm file of the store's arena."""
    offsets: list[int]
    """Per key: the slot's byte offset to write, -1 held already (or being written), -2 no room."""
    lease: int = 0
    """The reservation, committed by a :class:`CachePut` with this ``lease`` (0: no slot reserved)."""
    lease_s: float = 0.0
    """Seconds after which uncommitted slots are taken back."""


class CacheRelease(Message, tag="cache_release", kw_only=True):
    request_id: str = ""
    """Caller-chosen id."""
    lease: int
    """A get's lease (its slots are read) or a reservation (abandoned)."""


class CacheExistsReply(Message, tag="cache_exists_reply", kw_only=True):
    request_id: str = ""
    """Id of the request answered."""
    exists: list[bool]
    """Presence per key."""


class CacheEntry(msgspec.Struct, kw_only=True):
    key: str
    """Block key, hex."""
    tier: str
    """"ram", "disk" or "mooncake"."""
    nbytes: int
    """Payload bytes."""
    meta: Optional[BlockMeta] = None
    """Layout the block was stored with."""


class CacheListReply(Message, tag="cache_list_reply", kw_only=True):
    request_id: str = ""
    """Id of the request answered."""
    entries: list[CacheEntry]
    """Blocks held, most recently used first."""


class CachePruneReply(Message, tag="cache_prune_reply", kw_only=True):
    request_id: str = ""
    """Id of the request answered."""
    num_removed: int
    """Blocks removed."""
    bytes_freed: int
    """Payload bytes removed."""


class CacheStats(Message, tag="cache_stats_reply", kw_only=True):
    request_id: str = ""
    """Id of the request answered."""
    num_blocks: int
    """Blocks held."""
    bytes_used: int
    """Bytes held."""
    capacity_bytes: int
    """Byte capacity."""
    hits: int
    """Keys found by get."""
    misses: int
    """Keys not found by get."""
    evictions: int
    """Blocks evicted to make room."""
    puts: int
    """Blocks stored."""
    rejected: int = 0
    """Blocks refused or not served because their layout did not match the request's ``meta``."""
    corrupt: int = 0
    """Disk blocks that failed their checksum (dropped, answered as misses)."""
    ram_bytes: int = 0
    """Bytes in the RAM tier."""
    disk_bytes: int = 0
    """Bytes in the disk tier."""
    disk_blocks: int = 0
    """Blocks in the disk tier."""
    backend: str = "memory"
    """The store's backend: memory or mooncake."""
    mooncake_master: str = ""
    """host:port of the Mooncake master (backend mooncake), for clients of the pool."""
    mooncake_metadata: str = ""
    """URL of the Mooncake metadata server (backend mooncake)."""
    arena: str = ""
    """The /dev/shm file of the RAM tier's shared arena (empty: none; same-host engines map it)."""
    leased: int = 0
    """Slots leased to readers or reserved by writers now."""
    refused: int = 0
    """Blocks a reservation found no room for (every slot leased)."""


AnyMessage = Union[
    GenerateRequest, GenerateResponse, LoadWeights, WeightsLoaded, HealthRequest, HealthResponse,
    ErrorReply, Shutdown, AbortRequests, WeightsPublished, PolicyUpdated, BatchWritten, CachePut, CacheGet, CacheExists,
    CacheStatsRequest, CacheReply, CacheGetReply, CacheExistsReply, CacheStats, CacheList, CacheListReply,
    CachePrune, CachePruneReply, CacheReserve, CacheReserveReply, CacheRelease,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode_envelope(data: bytes) -> Envelope:
    """Raises msgspec.DecodeError when ``data`` is not a msgpack message."""
    return _envelope_decoder.decode(data)


def decode(data: bytes) -> Message:
    """Decode a message, checking the protocol version first.

    Raises ``ValueError`` with a message fit for an ErrorReply when the bytes are not a
    message, come from another protocol version, or have an unknown type.
    """
    try:
        env = decode_envelope(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"not an rlcli message: {e}") from None
    if env.protocol != PROTOCOL_VERSION:
        raise ValueError(
            f"protocol version {env.protocol} is not supported (this is version {PROTOCOL_VERSION}); "
            "run the same rlcli version on every process"
        )
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"malformed {env.type!r} message: {e}") from None
