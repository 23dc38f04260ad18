"""The ``KVConnector`` seam: an engine's link to a shared KV-block store (rl-cache).

Before prefill, an engine that misses a prefix locally asks the store for the longest
run of the prompt's next blocks (:meth:`KVConnector.fetch_async`): a background fetch
thread (one for fetches of up to ``EXPRESS_BYTES``, another for larger ones, so a small
fetch never queues behind a large transfer) sends one store request for the whole run,
whose bytes land in host memory the device can read directly (a memory store on this
host writes them into the engine's /dev/shm mailbox, registered with CUDA; otherwise
pinned staging memory), copies them to the device on its own CUDA stream and marks the
:class:`FetchTicket` done. The engine keeps stepping its other requests meanwhile and
admits the waiting one once its ticket is done (:meth:`FetchTicket.take` hands the
payloads over to the engine's stream). After prefill, and when a completion finishes,
the engine hands the new full blocks (gathered on the device) to
:meth:`KVConnector.publish`, which only records an event and enqueues them: a publishing
thread copies them out on its own CUDA stream into pinned memory (never queued behind,
or blocking, the engine's stream) and moves them to the store with its own socket, so
publishing never delays a decode step; when the bounded queue is full a batch is dropped
(and counted), never waited for. ``flush`` waits for what was queued (a prefill server
answers only once its blocks are stored, so the decode server finds them).

Keys are the engine's chain hashes (cache salt, weights version, tokens); every request
carries the engine's :class:`BlockMeta` (model fingerprint, dtype, shape), so a store
never hands back another model's KV. ZeroMQ carries keys and layouts; payloads move
through the store backend's path: the store's shared arena for a memory store on this host
(``rlcli.infer.arena_connector``: one copy each way, none in the store), else /dev/shm
mailboxes (``transfer = "shm"``) or inline in the message (another host), Mooncake's transfer
engine for a mooncake store.
:func:`make_kv_connector` asks the store which backend it runs and builds the connector.
"""

import queue
import socket
import threading
import time
from functools import partial
from typing import Protocol

import numpy as np
import torch

from rlcli.config.infer import KVCacheConfig
from rlcli.errors import ConfigError, PeerUnreachable
from rlcli.logging import setup_logging
from rlcli.protocol import (
    BlockMeta, CacheExists, CacheExistsReply, CacheGet, CacheGetReply, CachePut, CacheReply, CacheStats,
    CacheStatsRequest,
)
from rlcli.transport import shm
from rlcli.transport.zmq import RpcClient, new_request_id

log = setup_logging("rl-infer")
BATCH_BYTES = 32 << 20
"""Most payload bytes in one store request (rl-cache refuses messages past 256 MiB)."""
QUEUE_BYTES = 2 << 30
"""Most payload bytes waiting to be published (they hold device memory until copied out)."""
EXPRESS_BYTES = 64 << 20
"""Fetches asking for at most this many bytes take the express lane: a second fetch thread, so
they never queue behind a large transfer (each lane has its own socket, stream and mailbox)."""


class KVConnector(Protocol):
    meta: BlockMeta
    """Layout of this engine's blocks; the fingerprint changes with the weights."""
    fetch_bytes_per_s: float
    """Speed of recent large fetches (request to payloads on the device), to predict a fetch's time."""

    def fetch_async(self, keys: list[bytes]) -> "FetchTicket":
        """Start fetching the longest leading run of ``keys`` the store holds (in the background;
        fetches are served in the order they were asked for)."""
        ...

    def fetch(self, keys: list[bytes]) -> torch.Tensor:
        """:meth:`fetch_async`, waiting for it: its ticket's :meth:`~FetchTicket.take`."""
        ...

    def publish(self, keys: list[bytes], payload: torch.Tensor) -> bool:
        """Queue blocks for the store (``payload``: a ``[len(keys), meta.nbytes]`` uint8 tensor,
        on any device, computed on the caller's current stream); False when the queue is full
        and the batch was dropped."""
        ...

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued batch is stored; False on timeout."""
        ...

    def stats(self) -> dict[str, float]:
        ...

    def close(self) -> None:
        ...


def _call(client: RpcClient, msg, reply_type, timeout_s: float):
    reply = client.call(msg, timeout_s, peer="rl-cache")
    if not isinstance(reply, reply_type):
        raise PeerUnreachable(f"rl-cache answered {type(reply).__name__}: {getattr(reply, 'message', '')}")
    return reply


def _run_length(found: list[bool]) -> int:
    n = 0
    while n < len(found) and found[n]:
        n += 1
    return n


def _cudart_call(device: torch.device, name: str, *args) -> bool:
    """A CUDA runtime call on a helper thread: a failure leaves its error code on that thread,
    never on the engine's (where the next kernel launch check would raise it)."""
    result = []

    def call() -> None:
        try:
            cudart = torch.cuda.cudart()
            with torch.cuda.device(device):
                result.append(getattr(cudart, name)(*args) == cudart.cudaError.success)
        except Exception:  # best effort: an unregistered mapping still works, staged
            result.append(False)

    t = threading.Thread(target=call, name=f"kv-{name}")
    t.start()
    t.join()
    return bool(result and result[0])


def _register(device: torch.device, array: np.ndarray) -> None:
    """Page-lock a host mapping for CUDA, so copies to and from the device read it directly
    (left pageable, with a warning, where the driver refuses: copies are then staged)."""
    if not _cudart_call(device, "cudaHostRegister", array.ctypes.data, array.nbytes, 1):  # 1: portable
        log.warning("could not register a %d-byte /dev/shm mapping with CUDA: KV copies are staged", array.nbytes)


def _unregister(device: torch.device, array: np.ndarray) -> None:
    _cudart_call(device, "cudaHostUnregister", array.ctypes.data)


class FetchTicket:
    """One fetch in flight: its keys, then (``event`` set) the payloads of the leading run the store held."""

    def __init__(self, keys: list[bytes]):
        self.keys = keys
        self.event = threading.Event()
        self.data: torch.Tensor | None = None
        self.wait_s = 0.0  # time the store took to answer (queueing there included)
        self.on_release = None  # set when ``data`` is a view of store memory leased until :meth:`release`
        self.t_done = 0.0  # perf_counter when ``event`` was set

    def done(self) -> bool:
        return self.event.is_set()

    def take(self) -> torch.Tensor:
        """The payloads (once; the engine thread): ``[n, meta.nbytes]`` uint8 (n = 0 on a miss or
        an unreachable store), on the engine's device, ready for use on the caller's current stream."""
        assert self.done() and self.data is not None, "take() of a fetch in flight, or taken twice"
        data, self.data = self.data, None
        if data.is_cuda:  # made on the fetch stream: the caching allocator must not reuse it early
            data.record_stream(torch.cuda.current_stream(data.device))
        return data

    def release(self) -> None:
        """The taken payloads are copied (or dropped): memory the store leased for them may go."""
        release, self.on_release = self.on_release, None
        if release is not None:
            release()


class _Publisher:
    """The background fetch and publishing threads and the counters shared by both connectors."""

    reuses_fetch_buffer = False
    """Whether :meth:`_fetch` answers in memory the next fetch overwrites (copied out before then)."""

    max_fetch_bytes = BATCH_BYTES
    """Most payload bytes one fetch request asks for (payloads that do not cross ZeroMQ: no limit)."""

    def __init__(self, endpoint: str, meta: BlockMeta, queue_size: int, timeout_s: float,
                 device: torch.device | None = None):
        self.endpoint, self.meta, self.timeout_s = endpoint, meta, timeout_s
        self.device = device or torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        # The publisher's device-to-host copies run on this stream, beside the engine's.
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # Fetch lanes: 0 for fetches of up to EXPRESS_BYTES, 1 for larger ones.
        self.fetch_streams = [torch.cuda.Stream(self.device) if self.cuda else None for _ in range(2)]
        self.fetches: list[queue.Queue] = [queue.Queue(), queue.Queue()]
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.queued_bytes = 0  # payload bytes queued and not yet copied out
        self.bytes_lock = threading.Lock()
        self.counters = {"kv_fetch_requests": 0, "kv_fetched_blocks": 0, "kv_fetched_bytes": 0, "kv_fetch_s": 0.0,
                         "kv_fetch_store_s": 0.0, "kv_fetch_errors": 0, "kv_published_blocks": 0,
                         "kv_published_bytes": 0,
                         "kv_publish_skipped": 0, "kv_publish_dropped": 0, "kv_publish_refused": 0,
                         "kv_publish_errors": 0, "kv_publish_s": 0.0}
        self.fetch_bytes_per_s = 4e9  # until measured
        self.thread = threading.Thread(target=self._work, name="kv-publish", daemon=True)
        self.thread.start()
        self.fetchers = [threading.Thread(target=self._fetch_work, args=(lane,), name=f"kv-fetch-{lane}",
                                          daemon=True) for lane in range(2)]
        for t in self.fetchers:
            t.start()

    def publish(self, keys: list[bytes], payload: torch.Tensor) -> bool:
        if not keys:
            return True
        nbytes = payload.numel()
        ready = None
        if payload.is_cuda:  # the gather is queued on the engine's stream: the copy waits for it there
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(payload.device))
        with self.bytes_lock:
            try:
                if self.queued_bytes + nbytes > QUEUE_BYTES:
                    raise queue.Full
                # meta: the layout of the weights that computed them
                self.queue.put_nowait((list(keys), payload, ready, self.meta))
                self.queued_bytes += nbytes
                return True
            except queue.Full:
                self.counters["kv_publish_dropped"] += len(keys)
                return False

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.queue.all_tasks_done:
            while self.queue.unfinished_tasks:
                if not self.queue.all_tasks_done.wait(max(0.0, deadline - time.monotonic())):
                    return False
        return True

    def _work(self) -> None:
        client = RpcClient(self.endpoint)  # sockets are not shared between threads
        try:
            while (item := self.queue.get()) is not None:
                keys, batch = item[0], list(item)
                left = [item[1].numel()]  # queued bytes not yet copied out of the payload
                del item
                t0 = time.monotonic()
                try:
                    self._publish_batch(client, batch, left)
                except Exception as e:  # the store being down must not stop the engine
                    self.counters["kv_publish_errors"] += len(keys)
                    log.warning("could not publish %d KV blocks: %s", len(keys), e)
                finally:
                    batch.clear()
                    self._copied_out(left)
                    self.counters["kv_publish_s"] += time.monotonic() - t0
                    self.queue.task_done()
        finally:
            client.close()
            self.queue.task_done()

    def _copied_out(self, left: list[int]) -> None:
        """A batch's payload is copied out of the engine's memory: its bytes leave the queue's count."""
        with self.bytes_lock:
            self.queued_bytes -= left[0]
        left[0] = 0

    def _publish_batch(self, client: RpcClient, batch: list, left: list[int]) -> None:
        """Move one queued batch (``[keys, payload, ready, meta]``, emptied here so the payload's
        device memory goes once it is copied out) to the store, on the publishing thread: to the
        host, skip what the store holds, store the rest (:meth:`_copied_out` once on the host)."""
        keys, payload, ready, meta = batch
        batch.clear()
        rows = self._to_host(payload, ready)
        del payload
        self._copied_out(left)
        present = _call(client, CacheExists(request_id=new_request_id(), keys=keys), CacheExistsReply,
                        self.timeout_s).exists
        missing = [i for i, p in enumerate(present) if not p]
        self.counters["kv_publish_skipped"] += len(keys) - len(missing)
        step = max(1, self.max_fetch_bytes // meta.nbytes)
        for a in range(0, len(missing), step):
            chunk = missing[a:a + step]
            stored = self._store(client, [keys[i] for i in chunk], rows, chunk, meta)
            self.counters["kv_published_blocks"] += stored
            self.counters["kv_published_bytes"] += stored * meta.nbytes

    def _to_host(self, payload: torch.Tensor, ready) -> torch.Tensor:
        """The payload in host memory: for a device tensor, one copy on the publisher's stream
        (after the engine's gather, ``ready``) into :meth:`_staging`; only this thread waits for it."""
        if not payload.is_cuda:
            return payload.contiguous()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            host = self._staging(payload.shape[0])
            host.copy_(payload, non_blocking=True)
        self.copy_stream.synchronize()
        return host

    def _staging(self, num_blocks: int) -> torch.Tensor:
        """Host memory a published payload is copied into from the device."""
        return self._host_buffer(num_blocks)

    def _store(self, client: RpcClient, keys: list[bytes], rows: torch.Tensor, idx: list[int],
               meta: BlockMeta) -> int:
        """Move payloads ``rows[idx]`` to the store under ``keys``; returns how many it stored."""
        raise NotImplementedError

    def _host_buffer(self, num_blocks: int) -> torch.Tensor:
        """``[num_blocks, meta.nbytes]`` uint8 staging memory (pinned for a CUDA engine: torch's
        host allocator caches it, and keeps it until an asynchronous copy out of it is done)."""
        return torch.empty(num_blocks, self.meta.nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def _rows(self, values: list[bytes]) -> torch.Tensor:
        """Payloads (one per block) copied into one staging buffer."""
        out = self._host_buffer(len(values))
        dst = out.numpy()
        for i, v in enumerate(values):
            dst[i] = np.frombuffer(v, dtype=np.uint8)
        return out

    def fetch_async(self, keys: list[bytes]) -> FetchTicket:
        ticket = FetchTicket(list(keys))
        self.fetches[int(len(keys) * self.meta.nbytes > EXPRESS_BYTES)].put(ticket)
        return ticket

    def fetch(self, keys: list[bytes]) -> torch.Tensor:
        ticket = self.fetch_async(keys)
        ticket.event.wait()
        data = ticket.take()
        if ticket.on_release is not None:
            data = data.clone()
            ticket.release()
        return data

    def _fetch_work(self, lane: int) -> None:
        client = RpcClient(self.endpoint)  # this thread's own socket
        try:
            while (ticket := self.fetches[lane].get()) is not None:
                if callable(ticket):  # a store request queued for this lane's socket (a lease release)
                    ticket(client)
                    continue
                try:
                    t0 = time.monotonic()
                    ticket.data = self._fetch_run(lane, client, ticket)
                    if ticket.data.numel() >= 8 << 20:  # large enough to measure the path's speed
                        rate = ticket.data.numel() / max(time.monotonic() - t0, 1e-6)
                        self.fetch_bytes_per_s = 0.7 * self.fetch_bytes_per_s + 0.3 * rate
                except Exception as e:  # never leave the engine waiting on a ticket
                    self.counters["kv_fetch_errors"] += 1
                    log.warning("KV fetch failed (a miss): %s", e)
                    ticket.data = torch.empty(0, self.meta.nbytes, dtype=torch.uint8, device=self.device)
                ticket.t_done = time.perf_counter()
                ticket.event.set()
        finally:
            client.close()

    def _fetch_run(self, lane: int, client: RpcClient, ticket: FetchTicket) -> torch.Tensor:
        """The leading run of the ticket's keys, on the engine's device (the lane's fetch thread)."""
        t0 = time.monotonic()
        keys = ticket.keys
        parts, step = [], max(1, self.max_fetch_bytes // self.meta.nbytes)
        for a in range(0, len(keys), step):
            self.counters["kv_fetch_requests"] += 1
            t1 = time.monotonic()
            try:
                data = self._fetch(lane, client, keys[a:a + step])
            except (PeerUnreachable, OSError) as e:  # OSError: no room in /dev/shm for the mailbox
                self.counters["kv_fetch_errors"] += 1
                log.warning("KV fetch failed (a miss): %s", e)
                break
            finally:
                ticket.wait_s += time.monotonic() - t1
            parts.append(data)
            if data.shape[0] < min(step, len(keys) - a):
                break  # the run ended inside this batch
        data = parts[0] if len(parts) == 1 else (torch.cat(parts) if parts else self._host_buffer(0))
        if self.cuda:  # one copy to the device on this thread's stream; the host buffer is free after it
            stream = self.fetch_streams[lane]
            with torch.cuda.stream(stream):
                dev = torch.empty(data.shape, dtype=torch.uint8, device=self.device)
                dev.copy_(data, non_blocking=True)
            stream.synchronize()
            data = dev
        elif self.reuses_fetch_buffer and data.numel():
            data = data.clone()
        self.counters["kv_fetched_blocks"] += data.shape[0]
        self.counters["kv_fetched_bytes"] += data.numel()
        self.counters["kv_fetch_store_s"] += ticket.wait_s
        self.counters["kv_fetch_s"] += time.monotonic() - t0
        return data

    def _fetch(self, lane: int, client: RpcClient, keys: list[bytes]) -> torch.Tensor:
        """One store request, on fetch lane ``lane``'s thread: the leading run of ``keys`` the
        store holds, ``[n, meta.nbytes]`` uint8 on the host, valid until the lane's next fetch."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counters.items()}

    def close(self) -> None:
        self.flush(self.timeout_s)
        self.queue.put(None)
        for q in self.fetches:
            q.put(None)
        self.thread.join(timeout=self.timeout_s)
        for t in self.fetchers:
            t.join(timeout=self.timeout_s)


class StoreConnector(_Publisher):
    """rl-cache's memory (RAM/disk) store; payloads through /dev/shm (``via_shm``) or inline.

    Through /dev/shm the engine keeps three :class:`~rlcli.transport.shm.Mailbox` files (one
    per fetch lane, the express one sized up front, and one to publish), registered with CUDA
    for a CUDA engine: the store writes a fetched run into the lane's mailbox (one copy), the
    device reads it from there; a published payload is copied from the device straight into
    the publish mailbox, the store reads it (one copy)."""

    def __init__(self, endpoint: str, meta: BlockMeta, queue_size: int, timeout_s: float, via_shm: bool,
                 device: torch.device | None = None):
        self.via_shm = self.reuses_fetch_buffer = via_shm
        if via_shm:
            self.max_fetch_bytes = 1 << 62  # one request per fetch or publish: only keys cross ZeroMQ
            cuda = device is not None and device.type == "cuda"
            hooks = (partial(_register, device), partial(_unregister, device)) if cuda else (None, None)
            self.fetch_boxes = [shm.Mailbox(*hooks), shm.Mailbox(*hooks)]  # one per fetch lane
            self.fetch_boxes[0].view(EXPRESS_BYTES)  # mapped (and registered) now, not on a first small fetch
            self.publish_box = shm.Mailbox(*hooks)
        super().__init__(endpoint, meta, queue_size, timeout_s, device)

    def _fetch(self, lane: int, client: RpcClient, keys: list[bytes]) -> torch.Tensor:
        nbytes = self.meta.nbytes
        box = self.fetch_boxes[lane] if self.via_shm else None
        into = box.view(len(keys) * nbytes) if self.via_shm else None
        msg = CacheGet(request_id=new_request_id(), keys=keys, meta=self.meta, prefix=True,
                       transfer="shm" if self.via_shm else "", into=box.name if self.via_shm else "")
        reply = _call(client, msg, CacheGetReply, self.timeout_s)
        n = _run_length(reply.found)
        if not self.via_shm:
            return self._rows(reply.values[:n])
        if n and reply.shm != box.name:
            raise PeerUnreachable("rl-cache did not write into this engine's /dev/shm mailbox")
        return torch.from_numpy(into[:n * nbytes]).view(n, nbytes)

    def _staging(self, num_blocks: int) -> torch.Tensor:
        if not self.via_shm:
            return self._host_buffer(num_blocks)
        nbytes = self.meta.nbytes
        return torch.from_numpy(self.publish_box.view(num_blocks * nbytes)).view(num_blocks, nbytes)

    def _store(self, client: RpcClient, keys: list[bytes], rows: torch.Tensor, idx: list[int],
               meta: BlockMeta) -> int:
        if not self.via_shm:
            values = [rows[i].numpy().tobytes() for i in idx]
            return _call(client, CachePut(request_id=new_request_id(), keys=keys, values=values, meta=meta),
                         CacheReply, self.timeout_s).num_stored
        box = self.publish_box.view(len(idx) * meta.nbytes).reshape(len(idx), meta.nbytes)
        src = rows.numpy()
        if not np.shares_memory(src, box):
            np.take(src, idx, axis=0, out=box, mode="clip")  # one copy, no temporary
        elif idx != list(range(len(idx))):  # else: already in place
            box[:] = src[idx]  # (fancy indexing copies first: overlap is safe)
        msg = CachePut(request_id=new_request_id(), keys=keys, meta=meta, shm=self.publish_box.name)
        return _call(client, msg, CacheReply, self.timeout_s).num_stored

    def close(self) -> None:
        super().close()
        if self.via_shm:
            for box in self.fetch_boxes:
                box.close()
            self.publish_box.close()


class MooncakeConnector(_Publisher):
    """rl-cache's mooncake store: this engine joins the pool as a client (mounting no memory);
    rl-cache answers which keys it holds, the payloads move through Mooncake."""

    def __init__(self, endpoint: str, meta: BlockMeta, queue_size: int, timeout_s: float, master: str,
                 metadata_server: str, device: torch.device | None = None):
        from rlcli.transport.mooncake import MooncakePool

        master_host = master.rpartition(":")[0]
        local = "127.0.0.1" if master_host in ("127.0.0.1", "localhost") else socket.gethostbyname(socket.gethostname())
        self.pool = MooncakePool(host=local, master=master, metadata_server=metadata_server)
        self.lock = threading.Lock()  # the fetch and publish threads share the pool client
        self.max_fetch_bytes = 1 << 62  # payloads move through Mooncake: one request per fetch
        super().__init__(endpoint, meta, queue_size, timeout_s, device)

    def _fetch(self, lane: int, client: RpcClient, keys: list[bytes]) -> torch.Tensor:
        msg = CacheGet(request_id=new_request_id(), keys=keys, meta=self.meta, prefix=True, transfer="mooncake")
        n = _run_length(_call(client, msg, CacheGetReply, self.timeout_s).found)
        with self.lock:
            values = self.pool.get(keys[:n], [self.meta.nbytes] * n)
        run = _run_length([v is not None for v in values])
        return self._rows(values[:run])

    def _store(self, client: RpcClient, keys: list[bytes], rows: torch.Tensor, idx: list[int],
               meta: BlockMeta) -> int:
        src = rows.numpy()
        with self.lock:
            if not self.pool.put(keys, [memoryview(src[i]) for i in idx]):
                raise PeerUnreachable("Mooncake refused the blocks (pool full?)")
        msg = CachePut(request_id=new_request_id(), keys=keys, meta=meta, mooncake=True)
        return _call(client, msg, CacheReply, self.timeout_s).num_stored

    def close(self) -> None:
        super().close()
        self.pool.close()


def _is_local(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    if host in ("127.0.0.1", "localhost", "::1", socket.gethostname()):
        return True
    try:
        return socket.gethostbyname(host) == socket.gethostbyname(socket.gethostname())
    except OSError:
        return False


def make_kv_connector(cfg: KVCacheConfig, meta: BlockMeta, device: torch.device | None = None) -> KVConnector | None:
    """The connector for the store at ``cfg.endpoint`` (None when it is empty) of an engine on ``device``."""
    if not cfg.endpoint:
        return None
    if not cfg.endpoint.startswith("tcp://"):
        raise ConfigError(f"infer.kv_cache.endpoint must be tcp://host:port (--kv-cache), got {cfg.endpoint!r}")
    probe = RpcClient(cfg.endpoint)
    try:
        info = _call(probe, CacheStatsRequest(request_id=new_request_id()), CacheStats, cfg.timeout_s)
    except PeerUnreachable as e:
        raise PeerUnreachable(f"no rl-cache at --kv-cache {cfg.endpoint}: {e}") from None
    finally:
        probe.close()
    conn: KVConnector | None = None
    local = _is_local(cfg.endpoint)
    if info.backend == "mooncake":
        conn = MooncakeConnector(cfg.endpoint, meta, cfg.publish_queue, cfg.timeout_s, info.mooncake_master,
                                 info.mooncake_metadata, device)
    elif info.arena and cfg.transfer in ("auto", "arena") and local:
        from rlcli.infer.arena_connector import ArenaConnector

        try:
            conn = ArenaConnector(cfg.endpoint, meta, cfg.publish_queue, cfg.timeout_s, info.arena, device)
        except ValueError as e:  # its /dev/shm is not this one (another container)
            log.warning("cannot map rl-cache's arena (%s): payloads through copies", e)
    if conn is None and cfg.transfer == "arena":
        raise ConfigError(f"infer.kv_cache.transfer is arena but rl-cache at {cfg.endpoint} has no arena this "
                          "process can map (same host, memory backend, room in /dev/shm): use auto")
    if conn is None:
        via_shm = cfg.transfer == "shm" or (cfg.transfer == "auto" and local and shm.available())
        conn = StoreConnector(cfg.endpoint, meta, cfg.publish_queue, cfg.timeout_s, via_shm, device)
    via = "mooncake" if info.backend == "mooncake" else getattr(conn, "via", "") or (
        "shm" if conn.via_shm else "zeromq")
    log.info("KV blocks shared through rl-cache at %s (%s backend, payloads via %s)", cfg.endpoint, info.backend, via)
    return conn
