"""Client side of rl-cache: a typed wrapper around the request/reply messages (used by the
``rl-cache stats|ls|prune`` commands and tests; engines talk to the store through their
own connector in ``rlcli.infer.kv_connector``)."""

from pathlib import Path

import msgspec

from rlcli.errors import ConfigError, PeerUnreachable, ProtocolError
from rlcli.protocol import (
    BlockMeta, CacheExists, CacheExistsReply, CacheGet, CacheGetReply, CacheList, CacheListReply, CachePrune,
    CachePruneReply, CachePut, CacheReply, CacheStats, CacheStatsRequest,
)
from rlcli.transport import shm
from rlcli.transport.registry import list_entries
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcClient, new_request_id


def find_endpoint(run_dir: Path | None, connect: str | None) -> str:
    if connect:
        return connect
    if run_dir is None:
        raise ConfigError("pass --connect tcp://host:port or --run-dir of a run with a live rl-cache")
    entries = list_entries(RunDir(run_dir).registry_dir(), "cache")
    if not entries:
        raise PeerUnreachable(f"no live rl-cache registered in {RunDir(run_dir).registry_dir()}")
    return entries[0].endpoints["rpc"]


class CacheClient:
    def __init__(self, endpoint: str, timeout_s: float = 5.0):
        self.client = RpcClient(endpoint)
        self.timeout_s = timeout_s

    def _call(self, msg, reply_type):
        reply = self.client.call(msg, self.timeout_s, peer="rl-cache")
        if not isinstance(reply, reply_type):
            raise ProtocolError(f"rl-cache answered {type(reply).__name__}: {getattr(reply, 'message', '')}")
        return reply

    def put(self, keys: list[bytes], values: list[bytes], meta: BlockMeta | None = None, via_shm: bool = False) -> int:
        if not via_shm:
            return self._call(CachePut(request_id=new_request_id(), keys=keys, values=values, meta=meta),
                              CacheReply).num_stored
        name = shm.write_payloads(values)
        try:
            return self._call(CachePut(request_id=new_request_id(), keys=keys, meta=meta, shm=name),
                              CacheReply).num_stored
        finally:
            shm.remove(name)

    def get(self, keys: list[bytes], meta: BlockMeta | None = None, prefix: bool = False,
            via_shm: bool = False) -> list[bytes | None]:
        msg = CacheGet(request_id=new_request_id(), keys=keys, meta=meta, prefix=prefix,
                       transfer="shm" if via_shm else "")
        reply = self._call(msg, CacheGetReply)
        if not via_shm:
            return reply.values
        if not reply.shm:
            return [None] * len(keys)
        try:
            found = iter(shm.read_payloads(reply.shm, meta.nbytes, sum(reply.found)))
        finally:
            shm.remove(reply.shm)
        return [next(found) if f else None for f in reply.found]

    def exists(self, keys: list[bytes]) -> list[bool]:
        return self._call(CacheExists(request_id=new_request_id(), keys=keys), CacheExistsReply).exists

    def stats(self) -> dict:
        reply = self._call(CacheStatsRequest(request_id=new_request_id()), CacheStats)
        out = msgspec.structs.asdict(reply)
        for key in ("type", "protocol", "request_id"):
            out.pop(key, None)
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else 0.0
        return out

    def ls(self, limit: int = 1000) -> list[dict]:
        reply = self._call(CacheList(request_id=new_request_id(), limit=limit), CacheListReply)
        return [msgspec.to_builtins(e) for e in reply.entries]

    def prune(self, fingerprint: str = "", tier: str = "") -> dict[str, int]:
        reply = self._call(CachePrune(request_id=new_request_id(), fingerprint=fingerprint, tier=tier),
                           CachePruneReply)
        return {"num_removed": reply.num_removed, "bytes_freed": reply.bytes_freed}

    def close(self) -> None:
        self.client.close()


def query_stats(run_dir: Path | None, connect: str | None, timeout_s: float) -> dict:
    client = CacheClient(find_endpoint(run_dir, connect), timeout_s)
    try:
        return client.stats()
    finally:
        client.close()
