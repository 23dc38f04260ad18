"""The connector to rl-cache's shared arena: fetches and publishes with one copy each.

rl-cache's RAM tier is one /dev/shm file (``rlcli.cache.arena``) that this process maps once
(and, on a GPU, registers with CUDA: copies between the device and the slots are then DMA,
asynchronous, no staging). A fetch asks the store for the leading run of keys it holds; the
reply names each block's slot and leases them to this engine; the fetch thread copies each
contiguous run of slots to the device on its own stream, then releases the lease. On a CPU
engine the ticket hands the engine a view of the slots (when they form one run) that it
scatters into its KV blocks (the one copy) and then releases (the release goes to the store
through the fetch lane's socket). A publish reserves slots for the blocks the store lacks,
copies the gathered blocks into them (on a GPU one device-to-host copy per contiguous run, on
the publisher's stream) and commits; a put the store has no room for is refused and counted
(``kv_publish_refused``), never waited for. A lease or reservation held for more than half of
its term (the store may then reuse its slots) is given up: the fetch is a miss, the put is
abandoned. The store never copies a payload byte on these paths.
"""

import threading
import time
from functools import partial

import torch

from rlcli.errors import PeerUnreachable
from rlcli.infer.kv_connector import FetchTicket, _call, _run_length, log
from rlcli.infer.kv_transfer import _Publisher, _register, _unregister
from rlcli.protocol import (
    BlockMeta, CacheGet, CacheGetReply, CachePut, CacheRelease, CacheReply, CacheReserve, CacheReserveReply,
)
from rlcli.transport import shm
from rlcli.transport.zmq import RpcClient, new_request_id

_MAPPED: dict[str, list] = {}  # arena name -> [Mapping, connectors using it]: one mapping, one registration
_MAPPED_LOCK = threading.Lock()


def _attach(name: str, device: torch.device) -> shm.Mapping:
    """This process's mapping of the arena ``name`` (made, and registered with CUDA, once)."""
    with _MAPPED_LOCK:
        for old in [n for n, (m, users) in _MAPPED.items() if not users and n != name and not m.alive()]:
            _MAPPED.pop(old)[0].close()  # a store that is gone
        if name not in _MAPPED:
            hooks = (partial(_register, device), partial(_unregister, device)) if device.type == "cuda" else ()
            _MAPPED[name] = [shm.Mapping(name, *hooks), 0]
        _MAPPED[name][1] += 1
        return _MAPPED[name][0]


def _detach(mapping: shm.Mapping) -> None:
    with _MAPPED_LOCK:
        entry = _MAPPED.get(mapping.name)
        if entry is not None and entry[0] is mapping:
            entry[1] -= 1
            if not entry[1] and not mapping.alive():
                _MAPPED.pop(mapping.name)
                mapping.close()


def runs_of(rows: list[int], offsets: list[int], nbytes: int) -> list[tuple[int, int, int]]:
    """``(first row, end row, first offset)`` of each maximal run of consecutive rows whose slots
    are consecutive too (one copy each)."""
    out: list[tuple[int, int, int]] = []
    for r, o in zip(rows, offsets):
        if out and r == out[-1][1] and o == out[-1][2] + (r - out[-1][0]) * nbytes:
            out[-1] = (out[-1][0], r + 1, out[-1][2])
        else:
            out.append((r, r + 1, o))
    return out


class ArenaConnector(_Publisher):
    """rl-cache's memory store on this host, through its shared arena (module docstring)."""

    max_fetch_bytes = 1 << 62  # one request per fetch or publish: only keys and offsets cross ZeroMQ
    via = "arena"
    via_shm = False  # (the mailbox path's flag)

    def __init__(self, endpoint: str, meta: BlockMeta, queue_size: int, timeout_s: float, arena: str,
                 device: torch.device | None = None):
        self.lock = threading.Lock()  # the mapping, shared by the fetch and publishing threads
        self.mapping = _attach(arena, device or torch.device("cpu"))  # ValueError: not visible from here
        self.slots = torch.from_numpy(self.mapping.array)
        super().__init__(endpoint, meta, queue_size, timeout_s, device)

    def _arena(self, name: str) -> torch.Tensor:
        """The arena's bytes as a tensor (mapping a new arena if the store restarted)."""
        with self.lock:
            if name != self.mapping.name:
                old, self.mapping = self.mapping, _attach(name, self.device)
                self.slots = torch.from_numpy(self.mapping.array)
                _detach(old)
            return self.slots

    def _runs(self, name: str, rows: list[int], offsets: list[int]) -> tuple[torch.Tensor, list]:
        nbytes = self.meta.nbytes
        slots = self._arena(name)
        if any(o < 0 or o + nbytes > slots.numel() for o in offsets):
            raise PeerUnreachable(f"rl-cache named slots outside its {slots.numel()}-byte arena")
        return slots, runs_of(rows, offsets, nbytes)

    def _release(self, lease: int, client: RpcClient) -> None:
        try:
            _call(client, CacheRelease(request_id=new_request_id(), lease=lease), CacheReply, self.timeout_s)
        except Exception as e:  # the store takes it back at the lease's end
            log.warning("could not release KV lease %d: %s", lease, e)

    def _fetch_run(self, lane: int, client: RpcClient, ticket: FetchTicket) -> torch.Tensor:
        t0 = time.monotonic()
        nbytes = self.meta.nbytes
        self.counters["kv_fetch_requests"] += 1
        msg = CacheGet(request_id=new_request_id(), keys=ticket.keys, meta=self.meta, prefix=True, transfer="arena")
        try:
            reply = _call(client, msg, CacheGetReply, self.timeout_s)
        finally:
            ticket.wait_s += time.monotonic() - t0
        n = _run_length(reply.found)
        data = torch.empty(0, nbytes, dtype=torch.uint8, device=self.device)
        if n:
            try:
                slots, runs = self._runs(reply.arena, list(range(n)), reply.offsets[:n])
                if self.cuda:  # one DMA copy per run of slots, on this lane's stream
                    stream = self.fetch_streams[lane]
                    with torch.cuda.stream(stream):
                        data = torch.empty(n, nbytes, dtype=torch.uint8, device=self.device)
                        for a, b, o in runs:
                            data[a:b].view(-1).copy_(slots[o:o + (b - a) * nbytes], non_blocking=True)
                    stream.synchronize()
                elif len(runs) == 1:  # the engine copies from the slots into its blocks, then releases
                    data = slots[runs[0][2]:runs[0][2] + n * nbytes].view(n, nbytes)
                else:
                    data = torch.empty(n, nbytes, dtype=torch.uint8)
                    for a, b, o in runs:
                        data[a:b].view(-1).copy_(slots[o:o + (b - a) * nbytes])
                if time.monotonic() - t0 > reply.lease_s / 2:
                    raise PeerUnreachable(f"a KV lease was held {time.monotonic() - t0:.1f} s (store may reuse it)")
                if not self.cuda and len(runs) == 1:
                    ticket.on_release = partial(self.fetches[lane].put, partial(self._release, reply.lease))
            finally:
                if ticket.on_release is None:
                    self._release(reply.lease, client)
        self.counters["kv_fetched_blocks"] += n
        self.counters["kv_fetched_bytes"] += n * nbytes
        self.counters["kv_fetch_store_s"] += ticket.wait_s
        self.counters["kv_fetch_s"] += time.monotonic() - t0
        return data

    def _publish_batch(self, client: RpcClient, batch: list, left: list[int]) -> None:
        keys, payload, ready, meta = batch
        batch.clear()
        t0 = time.monotonic()
        reply = _call(client, CacheReserve(request_id=new_request_id(), keys=keys, meta=meta), CacheReserveReply,
                      self.timeout_s)
        rows = [i for i, o in enumerate(reply.offsets) if o >= 0]
        self.counters["kv_publish_skipped"] += sum(o == -1 for o in reply.offsets)
        self.counters["kv_publish_refused"] += sum(o == -2 for o in reply.offsets)
        if not rows:
            return
        try:
            slots, runs = self._runs(reply.arena, rows, [reply.offsets[i] for i in rows])
            nbytes = meta.nbytes
            if time.monotonic() - t0 > reply.lease_s / 2:  # its slots may be someone else's soon: write nothing
                raise PeerUnreachable(f"a KV reservation came {time.monotonic() - t0:.1f} s late")
            if payload.is_cuda:  # device to the slots, after the engine's gather (``ready``)
                with torch.cuda.stream(self.copy_stream):
                    self.copy_stream.wait_event(ready)
                    for a, b, o in runs:
                        slots[o:o + (b - a) * nbytes].view(b - a, nbytes).copy_(payload[a:b], non_blocking=True)
                self.copy_stream.synchronize()
            else:
                for a, b, o in runs:
                    slots[o:o + (b - a) * nbytes].view(b - a, nbytes).copy_(payload[a:b])
            del payload
            self._copied_out(left)
            msg = CachePut(request_id=new_request_id(), keys=[keys[i] for i in rows], meta=meta, lease=reply.lease)
            stored = _call(client, msg, CacheReply, self.timeout_s).num_stored
        except Exception:
            self._release(reply.lease, client)  # abandon the reservation
            raise
        self.counters["kv_published_blocks"] += stored
        self.counters["kv_published_bytes"] += stored * meta.nbytes

    def close(self) -> None:
        super().close()
        with self.lock:
            self.slots = torch.empty(0, dtype=torch.uint8)
            _detach(self.mapping)
