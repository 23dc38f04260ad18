"""rl-cache behind vLLM's KV-connector seam: ``rl-infer --engine vllm --kv-cache ENDPOINT``.

vLLM loads :class:`RlCacheConnector` by module path (``kv_transfer_config``, built by
:func:`transfer_config`) twice: once beside its scheduler, once in each worker. The two
halves talk only through the per-step metadata the scheduler half builds.

Scheduler half (rl-infer's process: the engine core runs in it):

- **Lookup.** When vLLM admits a prompt, :meth:`get_num_new_matched_tokens` names the prompt's
  full blocks past vLLM's local prefix hit (never the block holding the last prompt token:
  vLLM computes at least one token) by chain keys (:func:`rlcli.infer.block_manager.chain_hash`
  over the request's ``cache_salt``, which the vLLM engine sets to ``"<salt>|w<weights version>"``)
  and asks rl-cache which exist (one ``CacheExists`` call). The leading run found is loaded
  **asynchronously**: vLLM allocates its blocks and parks the request
  (``WAITING_FOR_REMOTE_KVS``) while every other request keeps stepping.
- **What to store.** Each step, every scheduled request's blocks that this step's tokens
  complete (prompt and completion tokens whose ids are known) are planned for publishing,
  except those that came from the store or from vLLM's local prefix cache (this replica
  published them when it computed them).

Worker half (vLLM's worker: in-process on one device, a process per worker otherwise):

- **Load.** ``start_load_kv`` starts one background fetch per planned load (the connector of
  :func:`rlcli.infer.kv_connector.make_kv_connector`: the store's arena, /dev/shm mailboxes,
  inline bytes or Mooncake); ``get_finished`` copies each done fetch into its blocks and
  reports the request received (a step in which vLLM scheduled nothing waits up to
  ``IDLE_WAIT_S`` for a fetch instead of spinning, which would starve the fetch thread of the
  interpreter lock). Blocks the store no longer had, or holds for other weights
  (the payload layout's fingerprint differs), are reported as load errors, and vLLM recomputes
  from the first of them (``kv_load_failure_policy = "recompute"``).
- **Publish.** ``wait_for_save`` (after the step's forward) gathers the planned blocks from
  every layer's cache and queues them on the connector's publishing thread, as the native
  engine does (:func:`rlcli.infer.shared_kv.publish_run`: chain order, 256 MiB pieces, as far
  as the queue has room): the rest is dropped (counted), never waited for, except on a prefill
  server (``rl-infer --role prefill``), which drains the queue to make room. A prefill server answers each request (one
  token) only once every worker's queue is drained (:meth:`RlCacheConnector.flush`), so the
  decode server it hands the request to finds the prompt's blocks.

With tensor parallelism each worker holds its share of every block (its KV heads) and stores
it under its own key (:func:`shard_key`); the scheduler half looks up worker 0's keys, and a
worker whose share is missing reports load errors, so vLLM recomputes. A block's payload is,
layer by layer, that block's slice of the layer's KV cache tensor (whatever the attention
backend's layout: the block dimension is found by its size; caches of different dtypes, such as
an MLA latent and its indexer keys, side by side), as raw bytes. Its ``BlockMeta`` fingerprint
hashes the model config, that layout, the block size and the first 16 values of every
parameter; the worker recomputes it after each weight load
(:meth:`RlCacheConnector.set_fingerprint`, from ``rlcli.infer.vllm_worker``). Until it is set,
the worker neither loads (load errors: recompute) nor publishes. vLLM's payloads are not
interchangeable with the native engine's (another layout and fingerprint), so the two never
share blocks.

This module imports vLLM at import time: only vLLM's workers and the vLLM engine import it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
)

from rlcli.config.infer import KVCacheConfig
from rlcli.errors import PeerUnreachable
from rlcli.infer import kv_blocks
from rlcli.infer.block_manager import chain_hash
from rlcli.infer.shared_kv import publish_run
from rlcli.logging import setup_logging
from rlcli.protocol import BlockMeta, CacheExists, CacheExistsReply
from rlcli.transport.zmq import RpcClient, new_request_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = setup_logging("rl-infer")

CONNECTOR = "RlCacheConnector"
EXTRA_KEY = "rlcli_kv_cache"
ROLE_KEY = "rlcli_role"
MAX_FAILED_KEYS = 65536
LOOKUP_TIMEOUT_S = 1.0
LOOKUP_BACKOFF_S = 5.0
IDLE_WAIT_S = 0.01
"""Longest a step with no tokens scheduled waits in the worker for a fetch in flight."""
SCHEDULER_COUNTERS = ("kv_lookup_tokens", "kv_load_tokens", "kv_save_blocks", "kv_load_error_blocks")
WORKER_COUNTERS = ("kv_loaded_blocks", "kv_load_error_blocks", "kv_queued_blocks", "kv_unqueued_blocks")
"""The worker half's own counters; its stats add the store connector's (``kv_fetched_blocks``,
``kv_published_blocks``: what reached the store, ``kv_publish_skipped``: already there, ...)."""


def shard_key(key: bytes, rank: int, size: int) -> bytes:
    """The store key of tensor-parallel worker ``rank``'s share of a block (its KV heads): the block's
    chain key itself with one worker."""
    return key if size == 1 else hashlib.blake2b(key + f"/tp{rank}of{size}".encode(), digest_size=16).digest()


def transfer_config(kv: KVCacheConfig, role: str = "mixed"):
    """vLLM's ``KVTransferConfig`` for rl-cache at ``kv.endpoint`` and a server of ``role`` (a prefill
    server waits for room to publish instead of dropping): load failures are recomputed (vLLM builds
    without ``kv_load_failure_policy`` always recompute them)."""
    import dataclasses

    from vllm.config import KVTransferConfig

    fields = {f.name for f in dataclasses.fields(KVTransferConfig)}
    policy = {"kv_load_failure_policy": "recompute"} if "kv_load_failure_policy" in fields else {}
    return KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=__name__, kv_role="kv_both",
                            kv_connector_extra_config={EXTRA_KEY: msgspec.to_builtins(kv), ROLE_KEY: role},
                            **policy)


@dataclass
class Load:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class Save:
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class RlCacheMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


@dataclass
class _Tracked:
    """The scheduler half's view of one request."""

    request: Request
    keys: list[bytes] = field(default_factory=list)  # chain keys of its first len(keys) full blocks
    blocks: list[int] = field(default_factory=list)  # its block ids, in order
    published: int = 0  # blocks before this one are in the store (or were offered to it)
    local: int = 0  # blocks vLLM's local prefix cache held at the last lookup
    load: tuple[int, int] | None = None  # blocks [start, end) the last lookup found in the store

    def extend_keys(self, n: int, block_size: int) -> list[bytes]:
        tokens, salt = self.request.all_token_ids, self.request.cache_salt or ""
        while len(self.keys) < n:
            i = len(self.keys)
            self.keys.append(chain_hash(self.keys[-1] if i else None, salt, tokens[i * block_size:(i + 1) * block_size]))
        return self.keys


def _kv_config(vllm_config: VllmConfig) -> KVCacheConfig:
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    return msgspec.convert(extra[EXTRA_KEY], KVCacheConfig)


class RlCacheConnector(KVConnectorBase_V1):
    """Both halves (see the module docstring); ``role`` says which this instance is."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = _kv_config(vllm_config)
        self.prefill = vllm_config.kv_transfer_config.kv_connector_extra_config.get(ROLE_KEY) == "prefill"
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = 0  # the worker half's, set with its caches
        names = SCHEDULER_COUNTERS if role == KVConnectorRole.SCHEDULER else WORKER_COUNTERS
        self.counters: Counter[str] = Counter(dict.fromkeys(names, 0))
        # scheduler half
        self.tracked: dict[str, _Tracked] = {}
        self.pending_loads: list[Load] = []
        self.loads_in_flight: dict[str, Load] = {}
        self.failed_keys: OrderedDict[bytes, None] = OrderedDict()  # loads of these missed: never again
        self._store: RpcClient | None = None
        self._store_down = False
        self._retry_at = 0.0
        # worker half
        self.num_blocks = getattr(kv_cache_config, "num_blocks", 0)
        self.caches: list[torch.Tensor] = []  # per distinct cache tensor: a view with blocks on dim 0
        self.layout: list[list[int]] = []
        self.conn = None
        self.loading: dict[str, tuple[Any, list[int]]] = {}
        self.idle_step = False
        self.load_errors: set[int] = set()

    # ================================================================ scheduler half
    def _exists(self, keys: list[bytes]) -> list[bool]:
        """Which keys the store holds; none while it is unreachable. The lookup runs inside vLLM's scheduler
        loop: it waits at most ``LOOKUP_TIMEOUT_S``, and after a failure the store is not asked again for
        ``LOOKUP_BACKOFF_S``, so a dead store costs the scheduler one wait, not one per prompt."""
        if time.monotonic() < self._retry_at:
            return []
        if self._store is None:
            self._store = RpcClient(self.cfg.endpoint)
        try:
            reply = self._store.call(CacheExists(request_id=new_request_id(), keys=keys),
                                     min(self.cfg.timeout_s, LOOKUP_TIMEOUT_S), peer="rl-cache")
        except PeerUnreachable as e:
            if not self._store_down:
                log.warning("rl-cache at %s does not answer lookups (%s): prompts are computed", self.cfg.endpoint, e)
            self._store_down = True
            self._retry_at = time.monotonic() + LOOKUP_BACKOFF_S
            self._store.close()
            self._store = None
            return []
        if not isinstance(reply, CacheExistsReply):
            return []
        self._store_down = False
        return reply.exists

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        tracked = self.tracked.get(request.request_id)
        if tracked is None:
            tracked = self.tracked[request.request_id] = _Tracked(request)
        tracked.load = None
        full = (request.num_prompt_tokens - 1) // self.block_size  # the last prompt token is always computed
        first = tracked.local = num_computed_tokens // self.block_size
        if first >= full:
            return 0, False
        keys = tracked.extend_keys(full, self.block_size)
        found = self._exists([shard_key(k, 0, self.tp_size) for k in keys[first:full]])
        run = 0
        while run < len(found) and found[run] and keys[first + run] not in self.failed_keys:
            run += 1
        self.counters["kv_lookup_tokens"] += (full - first) * self.block_size
        if run == 0:
            return 0, False
        tracked.load = (first, first + run)
        return run * self.block_size, True

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        tracked = self.tracked.get(request.request_id)
        if tracked is None:
            tracked = self.tracked[request.request_id] = _Tracked(request)
        block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens > 0 and tracked.load is not None:
            start = tracked.load[0]
            end = start + num_external_tokens // self.block_size
            load = Load(request.request_id, tracked.keys[start:end], block_ids[start:end])
            self.pending_loads.append(load)
            self.loads_in_flight[request.request_id] = load
            self.counters["kv_load_tokens"] += (end - start) * self.block_size
            tracked.published = max(tracked.published, end)
        else:
            tracked.published = max(tracked.published, tracked.local)
        tracked.load = None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RlCacheMetadata(loads=self.pending_loads)
        self.pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if (tracked := self.tracked.get(new.req_id)) is not None:
                tracked.blocks = list(new.block_ids[0])
                self._plan_save(tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (tracked := self.tracked.get(req_id)) is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and back: its whole block list is new
                tracked.blocks = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracked.blocks += new_ids[0]
            self._plan_save(tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
        return meta

    def _plan_save(self, tracked: _Tracked, computed: int, meta: RlCacheMetadata) -> None:
        """Offer the store the blocks this step completes, as far as their token ids are known."""
        full = min(computed, len(tracked.request.all_token_ids), len(tracked.blocks) * self.block_size)
        full //= self.block_size
        if full <= tracked.published:
            return
        keys = tracked.extend_keys(full, self.block_size)
        meta.saves.append(Save(keys[tracked.published:full], tracked.blocks[tracked.published:full]))
        self.counters["kv_save_blocks"] += full - tracked.published
        tracked.published = full

    def update_connector_output(self, connector_output) -> None:
        """Remember the keys whose loads missed (evicted since the lookup, or stored by other weights), so a
        prompt that vLLM reschedules to recompute them is not sent to fetch them again."""
        invalid = connector_output.invalid_block_ids or set()
        for req_id in connector_output.finished_recving or ():
            load = self.loads_in_flight.pop(req_id, None)
            if load is None:
                continue
            for key, block in zip(load.keys, load.block_ids):
                if block in invalid:
                    self.failed_keys[key] = None
                    self.counters["kv_load_error_blocks"] += 1
            while len(self.failed_keys) > MAX_FAILED_KEYS:
                self.failed_keys.popitem(last=False)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.tracked.pop(request.request_id, None)
        return False, None  # a load still in flight keeps its blocks: vLLM frees them once it is received

    # ================================================================ worker half
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        self.tp_rank = get_tensor_model_parallel_rank()
        seen: set[int] = set()
        for name, cache in kv_caches.items():
            if cache.data_ptr() in seen:  # layers sharing one cache tensor
                continue
            seen.add(cache.data_ptr())
            dims = [d for d, size in enumerate(cache.shape) if size == self.num_blocks]
            if len(dims) != 1:
                raise ValueError(f"cannot find the block dimension of {name}'s KV cache {tuple(cache.shape)} "
                                 f"({self.num_blocks} blocks)")
            view = cache.movedim(dims[0], 0)
            self.caches.append(view)
            self.layout.append([*view.shape[1:], str(view.dtype).removeprefix("torch.")])
        if len({c.device for c in self.caches}) > 1:
            raise ValueError("KV caches on different devices cannot share one block payload")

    def set_fingerprint(self, model_config: dict, params: list[torch.Tensor]) -> None:
        """Name the blocks of the weights now served (the worker calls this after every load)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps([model_config, self.layout, self.block_size, self.tp_rank, self.tp_size],
                            sort_keys=True, default=str).encode())
        h.update(kv_blocks.weights_sample(params))
        nbytes = sum(c[0].numel() * c.element_size() for c in self.caches)
        meta = BlockMeta(fingerprint=h.hexdigest(), dtype="uint8", shape=[nbytes])
        if self.conn is None:
            from rlcli.infer.kv_connector import make_kv_connector

            self.conn = make_kv_connector(self.cfg, meta, self.caches[0].device)
        self.conn.meta = meta

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """``[len(block_ids), payload bytes]`` uint8: each cache's rows of those blocks, as bytes."""
        return kv_blocks.gather([(c,) for c in self.caches], block_ids)

    def _scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        kv_blocks.scatter([(c,) for c in self.caches], block_ids, data)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        # No attention metadata: vLLM scheduled no tokens this step (its requests wait for their loads).
        self.idle_step = getattr(forward_context, "attn_metadata", None) is None
        meta = self._get_connector_metadata()
        for load in meta.loads:
            if self.conn is None:  # no fingerprint yet: recompute
                self.load_errors.update(load.block_ids)
                self.loading[load.req_id] = (None, load.block_ids)
                continue
            keys = [shard_key(k, self.tp_rank, self.tp_size) for k in load.keys]
            self.loading[load.req_id] = (self.conn.fetch_async(keys), load.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # every layer's blocks go together in wait_for_save, after the forward

    def wait_for_save(self) -> None:
        if self.conn is None:
            return
        for save in self._get_connector_metadata().saves:
            keys = [shard_key(k, self.tp_rank, self.tp_size) for k in save.keys]
            done = publish_run(self.conn, keys, save.block_ids, self._gather, wait=self.prefill)
            self.counters["kv_queued_blocks"] += done
            self.counters["kv_unqueued_blocks"] += len(keys) - done  # no room in the publishing queue

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued block is stored; False on timeout."""
        return self.conn.flush(timeout_s) if self.conn is not None else True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.idle_step and self.loading:
            # Nothing else to run: wait (briefly, GIL released) for a fetch rather than spin through empty
            # steps, which starve the fetch thread of the interpreter lock.
            ticket = next((t for t, _ in self.loading.values() if t is not None and not t.done()), None)
            if ticket is not None:
                ticket.event.wait(IDLE_WAIT_S)
        done = set()
        for req_id, (ticket, block_ids) in list(self.loading.items()):
            if ticket is not None:
                if not ticket.done():
                    continue
                data = ticket.take()
                try:
                    n = min(data.shape[0], len(block_ids))
                    if n:
                        self._scatter(block_ids[:n], data[:n])
                finally:
                    ticket.release()
                self.counters["kv_loaded_blocks"] += n
                if n < len(block_ids):
                    self.load_errors.update(block_ids[n:])
                    self.counters["kv_load_error_blocks"] += len(block_ids) - n
            del self.loading[req_id]
            done.add(req_id)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        if self.conn is not None:
            out.update(self.conn.stats())
        return out

    def shutdown(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self._store is not None:
            self._store.close()
            self._store = None
