"""rl-cache serve: the block store behind a ROUTER socket (batch get/put/exists/stats)."""

from rlcli.cache.store import make_store
from rlcli.config import RecipeConfig
from rlcli.logging import setup_logging
from rlcli.process import stop_on_signals
from rlcli.protocol import (
    CacheExists, CacheExistsReply, CacheGet, CacheGetReply, CachePut, CacheReply, CacheStats, CacheStatsRequest,
    ErrorReply, HealthRequest, HealthResponse, Shutdown,
)
from rlcli.transport.registry import Registration
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcServer

log = setup_logging("rl-cache")


def serve(cfg: RecipeConfig, run: RunDir | None) -> int:
    store = make_store(cfg.cache)
    server = RpcServer(cfg.cache.host, cfg.cache.port)
    registration = Registration(run.registry_dir(), "cache", 0, {"rpc": server.endpoint}) if run else None
    log.info("%s store of %d MiB on %s", cfg.cache.backend, cfg.cache.capacity_mb, server.endpoint)
    state = {"stop": False}
    stop_on_signals(lambda: state.update(stop=True))
    try:
        while not state["stop"]:
            item = server.recv(200)
            if item is None:
                continue
            identity, msg = item
            rid = getattr(msg, "request_id", "")
            try:
                if isinstance(msg, CachePut):
                    reply = CacheReply(request_id=rid, num_stored=store.put(msg.keys, msg.values))
                elif isinstance(msg, CacheGet):
                    reply = CacheGetReply(request_id=rid, values=store.get(msg.keys))
                elif isinstance(msg, CacheExists):
                    reply = CacheExistsReply(request_id=rid, exists=store.exists(msg.keys))
                elif isinstance(msg, CacheStatsRequest):
                    reply = CacheStats(request_id=rid, **store.stats())
                elif isinstance(msg, (HealthRequest, Shutdown)):
                    reply = HealthResponse(request_id=rid, role="cache",
                                           stats={k: float(v) for k, v in store.stats().items()})
                    state["stop"] = isinstance(msg, Shutdown)
                else:
                    reply = ErrorReply(request_id=rid, message=f"rl-cache does not handle {type(msg).__name__}")
            except ValueError as e:
                reply = ErrorReply(request_id=rid, message=str(e))
            server.reply(identity, reply)
    finally:
        if registration:
            registration.close()
        server.close()
    return 0
