"""The Mooncake backend: payloads live in Mooncake's pool, rl-cache keeps the index.

``rl-cache serve --backend mooncake`` starts a ``mooncake_master`` (with its HTTP metadata
server) on ``cache.host`` unless ``cache.backend.master`` points to a running one, and
mounts ``cache.capacity_mb`` of its own memory into the pool. Engines join the pool as
clients (the master's address is in ``rl-cache stats``), put blocks there themselves and
tell rl-cache the keys and layout (a ``CachePut`` with ``mooncake=True``); a lookup asks
rl-cache which keys it holds with the requester's layout, then reads them from the pool.
So ZeroMQ carries only keys and layouts. rl-cache enforces the byte capacity over the
blocks it indexed (LRU, removing evicted ones from the pool), and checks the pool before
answering, in case Mooncake evicted a block itself.
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from collections import OrderedDict

from rlcli.cache.store import matches
from rlcli.config.services import MooncakeCacheBackend
from rlcli.errors import ConfigError
from rlcli.logging import setup_logging
from rlcli.protocol import BlockMeta, CacheEntry
from rlcli.transport.mooncake import MooncakePool

log = setup_logging("rl-cache")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the master's child process (Linux): SIGTERM when rl-cache dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def master_binary() -> str:
    try:
        import mooncake

        path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        if os.access(path, os.X_OK):
            return path
    except (ImportError, OSError):
        pass
    found = shutil.which("mooncake_master")
    if found is None:
        raise ConfigError("--backend mooncake needs mooncake_master: pip install 'rlcli[mooncake]', or set "
                          "cache.backend.master to a running master")
    return found


class MooncakeStore:
    """The index over Mooncake's pool; implements :class:`rlcli.cache.store.BlockStore` plus
    ``record``/``find`` for payloads that clients move through the pool themselves."""

    kind = "mooncake"

    def __init__(self, pool: MooncakePool, capacity_bytes: int, master: str, metadata_server: str,
                 master_proc: subprocess.Popen | None = None):
        self.pool, self.capacity = pool, capacity_bytes
        self.master, self.metadata_server, self.master_proc = master, metadata_server, master_proc
        self.index: OrderedDict[bytes, tuple[int, BlockMeta | None]] = OrderedDict()
        self.bytes_used = 0
        self.counters = {"hits": 0, "misses": 0, "evictions": 0, "puts": 0, "rejected": 0, "corrupt": 0}

    @classmethod
    def start(cls, host: str, capacity_bytes: int, cfg: MooncakeCacheBackend) -> "MooncakeStore":
        proc, master, metadata = None, cfg.master, cfg.metadata_server
        if not master:
            rpc, http, metrics = free_port(host), free_port(host), free_port(host)
            proc = subprocess.Popen([master_binary(), f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                                     f"--http_metadata_server_host={host}", f"--http_metadata_server_port={http}",
                                     f"--metrics_port={metrics}", f"--rpc_address={host}"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_die_with_parent)
            master, metadata = f"{host}:{rpc}", metadata or f"http://{host}:{http}/metadata"
            log.info("started mooncake_master (pid %d) on %s, metadata %s", proc.pid, master, metadata)
        if not metadata:
            raise ConfigError("cache.backend.master is set: also set cache.backend.metadata_server "
                              "(http://host:port/metadata)")
        deadline = time.monotonic() + 30
        while True:
            try:
                pool = MooncakePool(host=host, master=master, metadata_server=metadata, segment_bytes=capacity_bytes,
                                    protocol=cfg.protocol, device_names=cfg.device_names)
                return cls(pool, capacity_bytes, master, metadata, proc)
            except ConfigError:
                if proc is None or proc.poll() is not None or time.monotonic() > deadline:
                    if proc is not None:
                        proc.kill()
                    raise
                time.sleep(0.3)  # the master we started is not listening yet

    def _evict_to(self, limit: int) -> None:
        while self.bytes_used > limit and self.index:
            key, (nbytes, _) = self.index.popitem(last=False)
            self.bytes_used -= nbytes
            self.pool.remove(key)
            self.counters["evictions"] += 1

    def _index(self, key: bytes, nbytes: int, meta: BlockMeta | None) -> None:
        old = self.index.pop(key, None)
        if old is not None:
            self.bytes_used -= old[0]
        self.index[key] = (nbytes, meta)
        self.bytes_used += nbytes
        self._evict_to(self.capacity)

    def record(self, keys: list[bytes], meta: BlockMeta) -> int:
        """Index blocks a client put into the pool (those the pool really holds)."""
        stored = 0
        for key, present in zip(keys, self.pool.exists(keys)):
            if present and meta.nbytes <= self.capacity:
                self._index(key, meta.nbytes, meta)
                stored += 1
        self.counters["puts"] += stored
        return stored

    def put(self, keys: list[bytes], values: list[bytes], meta: BlockMeta | None = None) -> int:
        if len(keys) != len(values):
            raise ValueError(f"put: {len(keys)} keys but {len(values)} values")
        ok = [(k, v) for k, v in zip(keys, values) if len(v) <= self.capacity and (meta is None or len(v) == meta.nbytes)]
        self.counters["rejected"] += sum(meta is not None and len(v) != meta.nbytes for v in values)
        if ok and self.pool.put([k for k, _ in ok], [v for _, v in ok]):
            for k, v in ok:
                self._index(k, len(v), meta)
            self.counters["puts"] += len(ok)
            return len(ok)
        return 0

    def find(self, keys: list[bytes], meta: BlockMeta | None = None, prefix: bool = False) -> list[bool]:
        """Which keys the pool holds with layout ``meta`` (counted as hits and misses)."""
        ok: list[bool] = []
        for key in keys:
            item = self.index.get(key)
            good = item is not None and matches(item[1], meta)
            self.counters["rejected"] += item is not None and not good
            ok.append(good)
            if prefix and not good:
                break
        ok += [False] * (len(keys) - len(ok))
        candidates = [k for k, good in zip(keys, ok) if good]
        present = dict(zip(candidates, self.pool.exists(candidates)))
        found: list[bool] = []
        for key, good in zip(keys, ok):
            hit = good and present[key] and not (prefix and found and not found[-1])
            if good and not present[key] and key in self.index:  # Mooncake evicted it
                self.bytes_used -= self.index.pop(key)[0]
            if hit:
                self.index.move_to_end(key)
            self.counters["hits" if hit else "misses"] += 1
            found.append(hit)
        return found

    def get(self, keys: list[bytes], meta: BlockMeta | None = None, prefix: bool = False) -> list[bytes | None]:
        found = self.find(keys, meta, prefix)
        wanted = [k for k, f in zip(keys, found) if f]
        values = iter(self.pool.get(wanted, [self.index[k][0] for k in wanted]))
        return [next(values) if f else None for f in found]

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [k in self.index for k in keys]

    def entries(self, limit: int) -> list[CacheEntry]:
        return [CacheEntry(key=k.hex(), tier="mooncake", nbytes=self.index[k][0], meta=self.index[k][1])
                for k in list(reversed(self.index))[:limit]]

    def prune(self, fingerprint: str = "", tier: str = "") -> tuple[int, int]:
        doomed = [k for k, (_, m) in self.index.items() if not fingerprint or (m and m.fingerprint == fingerprint)]
        freed = 0
        for key in doomed:
            freed += self.index.pop(key)[0]
            self.pool.remove(key)
        self.bytes_used -= freed
        return len(doomed), freed

    def stats(self) -> dict:
        return {"num_blocks": len(self.index), "bytes_used": self.bytes_used, "capacity_bytes": self.capacity,
                "ram_bytes": self.bytes_used, **self.counters, "backend": "mooncake",
                "mooncake_master": self.master, "mooncake_metadata": self.metadata_server}

    def close(self) -> None:
        self.pool.close()
        if self.master_proc is not None and self.master_proc.poll() is None:
            self.master_proc.terminate()
            try:
                self.master_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.master_proc.kill()
                self.master_proc.wait()
