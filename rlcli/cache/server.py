"""rl-cache serve: the block store behind a ROUTER socket.

Batch get/put/exists, plus stats, list and prune. The socket thread answers small
requests itself; those that copy payloads through /dev/shm (puts and gets naming a file)
go to ``WORKERS`` threads, whose replies the socket thread sends when they are done, so
a large put being read never holds up another engine's lookup or fetch. The store is
touched under one lock and payloads are copied outside it (stored payloads are immutable
bytes); keys of a put still being read count as present for ``exists``, so two engines
publishing the same prefix do not both send it.

Large payloads do not cross ZeroMQ: a put names a /dev/shm file the requester wrote (it
deletes it once answered), a get with transfer "shm" is answered with a /dev/shm file the
store wrote (the requester deletes it after reading; files a requester never collected
are removed after ``ORPHAN_S``) or written into the requester's own file (``into``: a
reused mailbox, so no fresh pages), and with the Mooncake backend ZeroMQ carries only keys
and layouts while the payloads move through Mooncake's transfer engine. With the memory
backend's shared arena (:mod:`rlcli.cache.arena`) no payload byte crosses this process: a get
with transfer "arena" answers leased slot offsets, a put reserves slots (``CacheReserve``), the
requester writes them and commits (a ``CachePut`` naming the reservation), and
``CacheRelease`` ends a lease; gets through /dev/shm files are copied from leased slots
outside the lock. Inline payloads
stay accepted for peers on other hosts. Malformed requests get an ``ErrorReply``; the
loop keeps serving.
"""

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import zmq

from rlcli.cache.store import make_store
from rlcli.config import RecipeConfig
from rlcli.logging import setup_logging
from rlcli.process import stop_on_signals
from rlcli.protocol import (
    CacheExists, CacheExistsReply, CacheGet, CacheGetReply, CacheList, CacheListReply, CachePrune, CachePruneReply,
    CachePut, CacheRelease, CacheReply, CacheReserve, CacheReserveReply, CacheStats, CacheStatsRequest, ErrorReply,
    HealthRequest, HealthResponse, Shutdown,
)
from rlcli.transport import shm
from rlcli.transport.interval import IntervalCounters, ratio
from rlcli.transport.registry import Registration
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcServer

log = setup_logging("rl-cache")
ORPHAN_S = 60.0
COPY_THREADS = max(1, min(8, (os.cpu_count() or 1) // 4))
"""Threads that copy one large get or put between a requester's mailbox and the store (one on small hosts)."""
WORKERS = 4
"""Requests whose payloads cross /dev/shm served at once (their copies release the GIL)."""
INLINE_BYTES = 4 << 20
"""Payload copies up to this size run on the socket thread (a hand-off would cost more)."""


class CacheService:
    """The request handlers over one store (no sockets: tests drive it directly too)."""

    def __init__(self, store):
        self.store = store
        self.kind = getattr(store, "kind", "memory")
        self.outgoing: dict[str, float] = {}  # shm files written for gets -> when
        self.lock = threading.Lock()  # the store, outgoing and pending
        self.pending: dict[bytes, int] = {}  # keys of puts being read -> how many
        self.arena = getattr(store, "arena", None)  # the RAM tier's shared arena, if it has one

    def handle(self, msg, rid: str):
        """The reply to one request (any thread)."""
        reply = self.begin(msg, rid)
        return reply() if callable(reply) else reply

    def begin(self, msg, rid: str):
        """The reply, or, for a request that copies payloads through /dev/shm, a function that
        copies them and returns the reply (``.nbytes``: how many; a worker thread runs it).
        Lookups happen here, so a miss is answered at once."""
        store = self.store
        if isinstance(msg, CachePut):
            return self.put(msg, rid)
        if isinstance(msg, CacheGet):
            return self.get(msg, rid)
        if isinstance(msg, (CacheReserve, CacheRelease)) and self.arena is None:
            raise ValueError(f"{type(msg).__name__} needs rl-cache's shared arena (memory backend, room in /dev/shm)")
        with self.lock:
            if isinstance(msg, CacheReserve):
                lease, offsets = store.reserve(msg.keys, msg.meta)
                return CacheReserveReply(request_id=rid, arena=self.arena.name, offsets=offsets, lease=lease,
                                         lease_s=self.arena.lease_s)
            if isinstance(msg, CacheRelease):
                return CacheReply(request_id=rid, num_stored=int(store.release(msg.lease)))
            if isinstance(msg, CacheExists):
                return CacheExistsReply(request_id=rid, exists=[e or k in self.pending for k, e in
                                                                zip(msg.keys, store.exists(msg.keys))])
            if isinstance(msg, CacheStatsRequest):
                return CacheStats(request_id=rid, **store.stats())
            if isinstance(msg, CacheList):
                return CacheListReply(request_id=rid, entries=store.entries(max(0, min(msg.limit, 100_000))))
            if isinstance(msg, CachePrune):
                if msg.tier not in ("", "ram", "disk"):
                    raise ValueError(f"prune: tier must be ram or disk, got {msg.tier!r}")
                removed, freed = store.prune(msg.fingerprint, msg.tier)
                return CachePruneReply(request_id=rid, num_removed=removed, bytes_freed=freed)
            if isinstance(msg, (HealthRequest, Shutdown)):
                return HealthResponse(request_id=rid, role="cache",
                                      stats={k: float(v) for k, v in store.stats().items() if isinstance(v, int)})
        return ErrorReply(request_id=rid, message=f"rl-cache does not handle {type(msg).__name__}")

    def put(self, msg: CachePut, rid: str):
        if msg.mooncake:
            if self.kind != "mooncake" or msg.meta is None:
                raise ValueError("a mooncake put needs rl-cache --backend mooncake and the blocks' meta")
            with self.lock:
                return CacheReply(request_id=rid, num_stored=self.store.record(msg.keys, msg.meta))
        if msg.lease:
            if self.arena is None or msg.values or msg.shm:
                raise ValueError("a put naming a reservation needs the shared arena and carries no payloads")
            with self.lock:
                return CacheReply(request_id=rid, num_stored=self.store.commit(msg.lease, msg.keys))
        if not msg.shm:
            with self.lock:
                return CacheReply(request_id=rid, num_stored=self.store.put(msg.keys, msg.values, msg.meta))
        if msg.meta is None or msg.values:
            raise ValueError("a put through shm carries meta and no inline values")
        shm.path_of(msg.shm)  # a bad name is refused here, not on a worker
        with self.lock:
            for k in msg.keys:
                self.pending[k] = self.pending.get(k, 0) + 1

        def copy() -> CacheReply:
            try:
                values = shm.read_payloads(msg.shm, msg.meta.nbytes, len(msg.keys), COPY_THREADS)  # unlocked
                with self.lock:
                    return CacheReply(request_id=rid, num_stored=self.store.put(msg.keys, values, msg.meta))
            finally:
                with self.lock:
                    for k in msg.keys:
                        if self.pending[k] == 1:
                            del self.pending[k]
                        else:
                            self.pending[k] -= 1
        copy.nbytes = msg.meta.nbytes * len(msg.keys)
        return copy

    def get(self, msg: CacheGet, rid: str):
        if msg.transfer == "mooncake":
            if self.kind != "mooncake":
                raise ValueError("transfer mooncake needs rl-cache --backend mooncake")
            with self.lock:
                return CacheGetReply(request_id=rid, found=self.store.find(msg.keys, msg.meta, msg.prefix))
        if msg.transfer not in ("", "shm", "arena"):
            raise ValueError(f"unknown transfer {msg.transfer!r}")
        if msg.transfer in ("shm", "arena") and msg.meta is None:
            raise ValueError(f"a get through {msg.transfer} carries the requester's meta")
        if msg.into:
            shm.path_of(msg.into)  # a bad name (an arena's included) is refused here, before any lookup
        if msg.transfer == "arena" and self.arena is None:
            raise ValueError("transfer arena needs rl-cache's shared arena (memory backend, room in /dev/shm)")
        if self.arena is not None and msg.transfer:
            return self.get_leased(msg, rid)
        with self.lock:
            values = self.store.get(msg.keys, msg.meta, msg.prefix)
        found = [v is not None for v in values]
        if msg.transfer == "":
            return CacheGetReply(request_id=rid, values=values, found=found)
        if not any(found):
            return CacheGetReply(request_id=rid, found=found, shm="")
        payloads = [v for v in values if v is not None]

        def copy() -> CacheGetReply:
            return self.deliver(msg, rid, found, payloads)
        copy.nbytes = sum(len(v) for v in payloads)
        return copy

    def deliver(self, msg: CacheGet, rid: str, found: list[bool], payloads) -> CacheGetReply:
        """A get's payloads through /dev/shm, outside the lock: into the requester's mailbox (one
        copy into pages it already holds) or a new file the requester deletes."""
        if msg.into:
            shm.write_into(msg.into, payloads, COPY_THREADS)
            return CacheGetReply(request_id=rid, found=found, shm=msg.into)
        name = shm.write_payloads(payloads)
        with self.lock:
            self.outgoing[name] = time.monotonic()
        return CacheGetReply(request_id=rid, found=found, shm=name)

    def get_leased(self, msg: CacheGet, rid: str):
        """A get from the arena: the leased slots' offsets ("arena"), or (through a /dev/shm file)
        a copy of the leased slots made outside the lock, then released."""
        with self.lock:
            lease, offsets = self.store.lease(msg.keys, msg.meta, msg.prefix)
        found = [o is not None for o in offsets]
        held = [o for o in offsets if o is not None]
        if msg.transfer == "arena":
            return CacheGetReply(request_id=rid, found=found, arena=self.arena.name, offsets=held, lease=lease,
                                 lease_s=self.arena.lease_s)
        if not held:
            return CacheGetReply(request_id=rid, found=found, shm="")
        n = msg.meta.nbytes

        def copy() -> CacheGetReply:
            try:
                return self.deliver(msg, rid, found, [self.arena.view(o, n) for o in held])
            finally:
                with self.lock:
                    self.store.release(lease)
        copy.nbytes = n * len(held)
        return copy

    def sweep(self, max_age_s: float = ORPHAN_S) -> None:
        """Delete get payload files no requester collected; take back expired leases."""
        if self.arena is not None:
            with self.lock:
                self.store.expire()
        now = time.monotonic()
        with self.lock:
            old = list(self.outgoing.items())
        for name, t in old:
            if not shm.path_of(name).exists():
                self.outgoing.pop(name, None)
            elif now - t > max_age_s:
                shm.remove(name)
                self.outgoing.pop(name, None)

    def close(self) -> None:
        self.sweep(0.0)
        self.store.close()


def _answer(rid: str, make, *args):
    """``make(*args)`` as a reply; an error a request caused becomes an ErrorReply."""
    try:
        return make(*args)
    except ValueError as e:
        return ErrorReply(request_id=rid, message=str(e))
    except Exception as e:  # a request must never take the store down
        log.exception("failed to handle a request %s", rid)
        return ErrorReply(request_id=rid, message=f"{type(e).__name__}: {e}")


COUNTERS = ("hits", "misses", "puts", "evictions", "rejected", "corrupt")


def record_metrics(run: RunDir, service: CacheService, interval: IntervalCounters) -> None:
    """One record of the interval that ends now, if the store was used in it (RUN/metrics/cache.jsonl)."""
    with service.lock:
        stats = service.store.stats()
    d, dt = interval.take({k: stats.get(k, 0) for k in COUNTERS})
    if not any(d.values()):
        return
    run.append_metrics("cache", {"step": interval.index, "time": time.time(), "interval_s": dt, **d,
                                 "hit_rate": ratio(d["hits"], d["hits"] + d["misses"]),
                                 "num_blocks": stats["num_blocks"], "bytes_used": stats["bytes_used"],
                                 "capacity_bytes": stats["capacity_bytes"]})


def serve(cfg: RecipeConfig, run: RunDir | None) -> int:
    # Bind, then register, then make the store: a bind that fails (port in use, no such interface) or
    # a run another rl-cache holds is refused before a /dev/shm arena exists or its start is logged.
    # Requests that arrive before the loop wait in the socket.
    server = RpcServer(cfg.cache.host, cfg.cache.port)
    registration = None
    try:
        registration = Registration(run.registry_dir(), "cache", 0, {"rpc": server.endpoint}) if run else None
        service = CacheService(make_store(cfg.cache))
    except BaseException:
        if registration is not None:
            registration.close()
        server.close()
        raise
    log.info("%s store of %d MiB on %s", cfg.cache.backend.name, cfg.cache.capacity_mb, server.endpoint)
    state = {"stop": False}
    stop_on_signals(lambda: state.update(stop=True))
    workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="rl-cache-copy")
    done: queue.SimpleQueue = queue.SimpleQueue()  # (identity, reply) of requests workers served
    wake_r, wake_w = os.pipe()  # a worker's byte wakes the socket thread's poll
    os.set_blocking(wake_r, False)
    poller = zmq.Poller()
    poller.register(server.sock, zmq.POLLIN)
    poller.register(wake_r, zmq.POLLIN)

    def work(identity: bytes, rid: str, copy) -> None:
        done.put((identity, _answer(rid, copy)))
        os.write(wake_w, b"x")

    last_sweep = time.monotonic()
    interval = IntervalCounters(cfg.cache.metrics_interval_s if run else 0.0)
    try:
        while not state["stop"]:
            if registration:
                registration.beat()
            if time.monotonic() - last_sweep > 5:
                service.sweep()
                last_sweep = time.monotonic()
            if interval.due():
                record_metrics(run, service, interval)
            poller.poll(200)
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            while True:
                try:
                    server.reply(*done.get_nowait())
                except queue.Empty:
                    break
            while (item := server.recv(0)) is not None:
                identity, msg = item
                rid = getattr(msg, "request_id", "")
                reply = _answer(rid, service.begin, msg, rid)
                if callable(reply) and reply.nbytes > INLINE_BYTES:
                    workers.submit(work, identity, rid, reply)
                    continue
                if callable(reply):
                    reply = _answer(rid, reply)
                server.reply(identity, reply)
                if isinstance(msg, Shutdown):
                    state["stop"] = True
                    break
    finally:
        workers.shutdown(wait=True)
        while True:
            try:
                server.reply(*done.get_nowait())
            except queue.Empty:
                break
        os.close(wake_r)
        os.close(wake_w)
        if registration:
            registration.close()
        server.close()
        service.close()
    return 0
