"""The ``KVConnector`` seam: an engine's link to a shared KV-block store (rl-cache).

Before prefill, an engine that misses a prefix locally asks the store for the longest
run of the prompt's next blocks (:meth:`KVConnector.fetch`, on the engine thread: the
request waits for it either way). After prefill, and when a completion finishes, it
hands the new full blocks to :meth:`KVConnector.publish`, which only enqueues them: a
background thread with its own socket moves them to the store, so publishing never
delays a decode step; when the bounded queue is full a batch is dropped (and counted),
never waited for. ``flush`` waits for what was queued (a prefill server answers only
once its blocks are stored, so the decode server finds them).

Keys are the engine's chain hashes (cache salt, weights version, tokens); every request
carries the engine's :class:`BlockMeta` (model fingerprint, dtype, shape), so a store
never hands back another model's KV. ZeroMQ carries keys and layouts; payloads move
through the store backend's path: /dev/shm files for a memory store on this host (inline
in the message otherwise), Mooncake's transfer engine for a mooncake store.
:func:`make_kv_connector` asks the store which backend it runs and builds the connector.
"""

import queue
import socket
import threading
import time
from typing import Protocol

import numpy as np

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


class KVConnector(Protocol):
    meta: BlockMeta
    """Layout of this engine's blocks; the fingerprint changes with the weights."""

    def fetch(self, keys: list[bytes]) -> bytes:
        """Payloads of the longest leading run of ``keys`` the store holds, back to back
        (``len // meta.nbytes`` blocks; empty on a miss or an unreachable store)."""
        ...

    def publish(self, keys: list[bytes], payload: "object") -> bool:
        """Queue blocks for the store (``payload``: a ``[len(keys), meta.nbytes]`` uint8 tensor,
        on any device); False when the queue is full and the batch was dropped."""
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


class _Publisher:
    """The background publishing thread and the counters shared by both connectors."""

    def __init__(self, endpoint: str, meta: BlockMeta, queue_size: int, timeout_s: float):
        self.endpoint, self.meta, self.timeout_s = endpoint, meta, timeout_s
        self.client = RpcClient(endpoint)  # the engine thread's socket (fetch)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.queued_bytes = 0  # payload bytes queued and not yet copied out
        self.bytes_lock = threading.Lock()
        self.counters = {"kv_fetch_requests": 0, "kv_fetched_blocks": 0, "kv_fetched_bytes": 0, "kv_fetch_s": 0.0,
                         "kv_fetch_errors": 0, "kv_published_blocks": 0, "kv_published_bytes": 0,
                         "kv_publish_skipped": 0, "kv_publish_dropped": 0, "kv_publish_errors": 0}
        self.thread = threading.Thread(target=self._work, name="kv-publish", daemon=True)
        self.thread.start()

    def publish(self, keys: list[bytes], payload) -> bool:
        if not keys:
            return True
        nbytes = payload.numel()
        with self.bytes_lock:
            try:
                if self.queued_bytes + nbytes > QUEUE_BYTES:
                    raise queue.Full
                self.queue.put_nowait((list(keys), payload, self.meta))  # the layout of the weights that computed them
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
                keys, payload, meta = item
                nbytes = payload.numel()
                try:
                    rows = np.ascontiguousarray(payload.cpu().numpy())  # the device copy happens here
                    del payload, item
                    with self.bytes_lock:
                        self.queued_bytes -= nbytes
                        nbytes = 0
                    present = _call(client, CacheExists(request_id=new_request_id(), keys=keys), CacheExistsReply,
                                    self.timeout_s).exists
                    missing = [i for i, p in enumerate(present) if not p]
                    self.counters["kv_publish_skipped"] += len(keys) - len(missing)
                    step = max(1, BATCH_BYTES // meta.nbytes)
                    for a in range(0, len(missing), step):
                        chunk = missing[a:a + step]
                        stored = self._store(client, [keys[i] for i in chunk], [rows[i] for i in chunk], meta)
                        self.counters["kv_published_blocks"] += stored
                        self.counters["kv_published_bytes"] += stored * meta.nbytes
                except Exception as e:  # the store being down must not stop the engine
                    self.counters["kv_publish_errors"] += len(keys)
                    log.warning("could not publish %d KV blocks: %s", len(keys), e)
                finally:
                    with self.bytes_lock:
                        self.queued_bytes -= nbytes
                    self.queue.task_done()
        finally:
            client.close()
            self.queue.task_done()

    def _store(self, client: RpcClient, keys: list[bytes], rows: list[np.ndarray], meta: BlockMeta) -> int:
        """Move payloads to the store; returns how many it stored (each connector's transfer path)."""
        raise NotImplementedError

    def fetch(self, keys: list[bytes]) -> bytes:
        t0 = time.monotonic()
        parts, step = [], max(1, BATCH_BYTES // self.meta.nbytes)
        for a in range(0, len(keys), step):
            self.counters["kv_fetch_requests"] += 1
            try:
                data = self._fetch(keys[a:a + step])
            except PeerUnreachable as e:
                self.counters["kv_fetch_errors"] += 1
                log.warning("KV fetch failed (a miss): %s", e)
                break
            parts.append(data)
            if len(data) < min(step, len(keys) - a) * self.meta.nbytes:
                break  # the run ended inside this batch
        data = b"".join(parts)
        self.counters["kv_fetched_blocks"] += len(data) // self.meta.nbytes
        self.counters["kv_fetched_bytes"] += len(data)
        self.counters["kv_fetch_s"] += time.monotonic() - t0
        return data

    def _fetch(self, keys: list[bytes]) -> bytes:
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counters.items()}

    def close(self) -> None:
        self.flush(self.timeout_s)
        self.queue.put(None)
        self.thread.join(timeout=self.timeout_s)
        self.client.close()


class StoreConnector(_Publisher):
    """rl-cache's memory (RAM/disk) store; payloads through /dev/shm (``via_shm``) or inline."""

    def __init__(self, endpoint: str, meta: BlockMeta, queue_size: int, timeout_s: float, via_shm: bool):
        self.via_shm = via_shm
        super().__init__(endpoint, meta, queue_size, timeout_s)

    def _fetch(self, keys: list[bytes]) -> bytes:
        msg = CacheGet(request_id=new_request_id(), keys=keys, meta=self.meta, prefix=True,
                       transfer="shm" if self.via_shm else "")
        reply = _call(self.client, msg, CacheGetReply, self.timeout_s)
        n = _run_length(reply.found)
        if not self.via_shm:
            return b"".join(reply.values[:n])
        if not reply.shm:
            return b""
        try:
            data = shm.read_all(reply.shm)
        except ValueError as e:
            raise PeerUnreachable(str(e)) from None
        finally:
            shm.remove(reply.shm)
        return data[:n * self.meta.nbytes]

    def _store(self, client: RpcClient, keys: list[bytes], rows: list[np.ndarray], meta: BlockMeta) -> int:
        if not self.via_shm:
            msg = CachePut(request_id=new_request_id(), keys=keys, values=[r.tobytes() for r in rows], meta=meta)
            return _call(client, msg, CacheReply, self.timeout_s).num_stored
        name = shm.write_payloads(memoryview(r) for r in rows)
        try:
            msg = CachePut(request_id=new_request_id(), keys=keys, meta=meta, shm=name)
            return _call(client, msg, CacheReply, self.timeout_s).num_stored
        finally:
            shm.remove(name)


class MooncakeConnector(_Publisher):
    """rl-cache's mooncake store: this engine joins the pool as a client (mounting no memory);
    rl-cache answers which keys it holds, the payloads move through Mooncake."""

    def __init__(self, endpoint: str, meta: BlockMeta, queue_size: int, timeout_s: float, master: str,
                 metadata_server: str):
        from rlcli.transport.mooncake import MooncakePool

        master_host = master.rpartition(":")[0]
        local = "127.0.0.1" if master_host in ("127.0.0.1", "localhost") else socket.gethostbyname(socket.gethostname())
        self.pool = MooncakePool(host=local, master=master, metadata_server=metadata_server)
        self.lock = threading.Lock()  # fetch (engine thread) and publish (worker) share the pool client
        super().__init__(endpoint, meta, queue_size, timeout_s)

    def _fetch(self, keys: list[bytes]) -> bytes:
        msg = CacheGet(request_id=new_request_id(), keys=keys, meta=self.meta, prefix=True, transfer="mooncake")
        n = _run_length(_call(self.client, msg, CacheGetReply, self.timeout_s).found)
        with self.lock:
            values = self.pool.get(keys[:n], [self.meta.nbytes] * n)
        run = _run_length([v is not None for v in values])
        return b"".join(values[:run])

    def _store(self, client: RpcClient, keys: list[bytes], rows: list[np.ndarray], meta: BlockMeta) -> int:
        with self.lock:
            if not self.pool.put(keys, [memoryview(r) for r in rows]):
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


def make_kv_connector(cfg: KVCacheConfig, meta: BlockMeta) -> KVConnector | None:
    """The connector for the store at ``cfg.endpoint`` (None when it is empty)."""
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
    if info.backend == "mooncake":
        conn: KVConnector = MooncakeConnector(cfg.endpoint, meta, cfg.publish_queue, cfg.timeout_s,
                                              info.mooncake_master, info.mooncake_metadata)
    else:
        via_shm = cfg.transfer == "shm" or (cfg.transfer == "auto" and _is_local(cfg.endpoint) and shm.available())
        conn = StoreConnector(cfg.endpoint, meta, cfg.publish_queue, cfg.timeout_s, via_shm)
    log.info("KV blocks shared through rl-cache at %s (%s backend, payloads via %s)", cfg.endpoint, info.backend,
             "mooncake" if info.backend == "mooncake" else ("shm" if conn.via_shm else "zeromq"))
    return conn
