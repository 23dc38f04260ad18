"""Client side of rl-cache: a typed wrapper around the request/reply messages."""

from pathlib import Path

from rlcli.errors import ConfigError, PeerUnreachable, ProtocolError
from rlcli.protocol import (
    CacheExists, CacheExistsReply, CacheGet, CacheGetReply, CachePut, CacheReply, CacheStats, CacheStatsRequest,
)
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

    def put(self, keys: list[bytes], values: list[bytes]) -> int:
        return self._call(CachePut(request_id=new_request_id(), keys=keys, values=values), CacheReply).num_stored

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return self._call(CacheGet(request_id=new_request_id(), keys=keys), CacheGetReply).values

    def exists(self, keys: list[bytes]) -> list[bool]:
        return self._call(CacheExists(request_id=new_request_id(), keys=keys), CacheExistsReply).exists

    def stats(self) -> dict[str, int]:
        reply = self._call(CacheStatsRequest(request_id=new_request_id()), CacheStats)
        return {k: getattr(reply, k) for k in ("num_blocks", "bytes_used", "capacity_bytes", "hits", "misses",
                                               "evictions", "puts")}

    def close(self) -> None:
        self.client.close()


def query_stats(run_dir: Path | None, connect: str | None, timeout_s: float) -> dict[str, int]:
    client = CacheClient(find_endpoint(run_dir, connect), timeout_s)
    try:
        return client.stats()
    finally:
        client.close()
