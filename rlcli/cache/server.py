"""rl-cache serve: the block store behind a ROUTER socket.

Batch get/put/exists, plus stats, list and prune, answered one message at a time by one
thread (the store is not shared). Large payloads do not cross ZeroMQ: a put names a
/dev/shm file the requester wrote (it deletes it once answered), a get with transfer
"shm" is answered with a /dev/shm file the store wrote (the requester deletes it after
reading; files a requester never collected are removed after ``ORPHAN_S``) or written
into the requester's own file (``into``: a reused mailbox, so no fresh pages), and with the
Mooncake backend ZeroMQ carries only keys and layouts while the payloads move through
Mooncake's transfer engine. Inline payloads stay accepted for peers on other hosts.
Malformed requests get an ``ErrorReply``; the loop keeps serving.
"""

import os
import time

from rlcli.cache.store import make_store
from rlcli.config import RecipeConfig
from rlcli.logging import setup_logging
from rlcli.process import stop_on_signals
from rlcli.protocol import (
    CacheExists, CacheExistsReply, CacheGet, CacheGetReply, CacheList, CacheListReply, CachePrune, CachePruneReply,
    CachePut, CacheReply, CacheStats, CacheStatsRequest, ErrorReply, HealthRequest, HealthResponse, Shutdown,
)
from rlcli.transport import shm
from rlcli.transport.registry import Registration
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcServer

log = setup_logging("rl-cache")
ORPHAN_S = 60.0
COPY_THREADS = max(1, min(8, (os.cpu_count() or 1) // 4))
"""Threads that copy a large get into a requester's mailbox (one on small hosts)."""


class CacheService:
    """The request handlers over one store (no sockets: tests drive it directly too)."""

    def __init__(self, store):
        self.store = store
        self.kind = getattr(store, "kind", "memory")
        self.outgoing: dict[str, float] = {}  # shm files written for gets -> when

    def handle(self, msg, rid: str):
        store = self.store
        if isinstance(msg, CachePut):
            return CacheReply(request_id=rid, num_stored=self.put(msg))
        if isinstance(msg, CacheGet):
            return self.get(msg, rid)
        if isinstance(msg, CacheExists):
            return CacheExistsReply(request_id=rid, exists=store.exists(msg.keys))
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

    def put(self, msg: CachePut) -> int:
        if msg.mooncake:
            if self.kind != "mooncake" or msg.meta is None:
                raise ValueError("a mooncake put needs rl-cache --backend mooncake and the blocks' meta")
            return self.store.record(msg.keys, msg.meta)
        if msg.shm:
            if msg.meta is None or msg.values:
                raise ValueError("a put through shm carries meta and no inline values")
            values = shm.read_payloads(msg.shm, msg.meta.nbytes, len(msg.keys))
        else:
            values = msg.values
        return self.store.put(msg.keys, values, msg.meta)

    def get(self, msg: CacheGet, rid: str) -> CacheGetReply:
        if msg.transfer == "mooncake":
            if self.kind != "mooncake":
                raise ValueError("transfer mooncake needs rl-cache --backend mooncake")
            return CacheGetReply(request_id=rid, found=self.store.find(msg.keys, msg.meta, msg.prefix))
        if msg.transfer not in ("", "shm"):
            raise ValueError(f"unknown transfer {msg.transfer!r}")
        values = self.store.get(msg.keys, msg.meta, msg.prefix)
        found = [v is not None for v in values]
        if msg.transfer == "":
            return CacheGetReply(request_id=rid, values=values, found=found)
        if msg.meta is None:
            raise ValueError("a get through shm carries the requester's meta")
        if msg.into:  # the requester's mailbox: one copy into pages it already holds
            shm.write_into(msg.into, [v for v in values if v is not None], COPY_THREADS)
            return CacheGetReply(request_id=rid, found=found, shm=msg.into if any(found) else "")
        name = shm.write_payloads(v for v in values if v is not None) if any(found) else ""
        if name:
            self.outgoing[name] = time.monotonic()
        return CacheGetReply(request_id=rid, found=found, shm=name)

    def sweep(self, max_age_s: float = ORPHAN_S) -> None:
        """Delete get payload files no requester collected."""
        now = time.monotonic()
        for name, t in list(self.outgoing.items()):
            if not shm.path_of(name).exists():
                del self.outgoing[name]
            elif now - t > max_age_s:
                shm.remove(name)
                del self.outgoing[name]

    def close(self) -> None:
        self.sweep(0.0)
        self.store.close()


def serve(cfg: RecipeConfig, run: RunDir | None) -> int:
    service = CacheService(make_store(cfg.cache))
    server = RpcServer(cfg.cache.host, cfg.cache.port)
    registration = Registration(run.registry_dir(), "cache", 0, {"rpc": server.endpoint}) if run else None
    log.info("%s store of %d MiB on %s", cfg.cache.backend.name, cfg.cache.capacity_mb, server.endpoint)
    state = {"stop": False}
    stop_on_signals(lambda: state.update(stop=True))
    last_sweep = time.monotonic()
    try:
        while not state["stop"]:
            if registration:
                registration.beat()
            if time.monotonic() - last_sweep > 5:
                service.sweep()
                last_sweep = time.monotonic()
            item = server.recv(200)
            if item is None:
                continue
            identity, msg = item
            rid = getattr(msg, "request_id", "")
            try:
                reply = service.handle(msg, rid)
            except ValueError as e:
                reply = ErrorReply(request_id=rid, message=str(e))
            except Exception as e:  # a request must never take the store down
                log.exception("failed to handle %s", type(msg).__name__)
                reply = ErrorReply(request_id=rid, message=f"{type(e).__name__}: {e}")
            state["stop"] = state["stop"] or isinstance(msg, Shutdown)
            server.reply(identity, reply)
    finally:
        if registration:
            registration.close()
        server.close()
        service.close()
    return 0
