"""Block stores: KV blocks under the engines' chained, salted, versioned block hashes.

A key is an engine's chain hash over (cache salt, weights version, tokens), so blocks of
another policy or another prompt never share a key; the store adds the block's layout
(:class:`BlockMeta`: model fingerprint, dtype, shape) so that two models that happen to
use the same salt and version can never read each other's KV: a put whose payload does
not have the size its meta names is refused, and a get from a requester with another
layout is answered as a miss (both counted as ``rejected``).

A store is a small interface (:class:`BlockStore`); :func:`make_store` picks the backend
named by ``cache.backend``; the memory backend's RAM tier is a shared-memory arena
(:mod:`rlcli.cache.arena`) where /dev/shm has the room. :class:`MemoryStore` is a byte-bounded LRU: a
put that would exceed the capacity evicts the least recently used blocks first (handing
them to ``spill``, the disk tier, when there is one), and a single block larger than the
whole capacity is refused.
"""

from collections import OrderedDict
from typing import Callable, Protocol

from rlcli.config.services import CacheConfig, MooncakeCacheBackend
from rlcli.protocol import BlockMeta, CacheEntry

Spill = Callable[[bytes, bytes, "BlockMeta | None"], None]


def matches(stored: BlockMeta | None, wanted: BlockMeta | None) -> bool:
    """Whether a block stored with ``stored`` may be served to a requester of layout ``wanted``."""
    return wanted is None or stored == wanted


class BlockStore(Protocol):
    def put(self, keys: list[bytes], values: list[bytes], meta: BlockMeta | None = None) -> int:
        """Store blocks; returns how many were stored."""
        ...

    def get(self, keys: list[bytes], meta: BlockMeta | None = None, prefix: bool = False) -> list[bytes | None]:
        """Payload per key (None: miss); with ``prefix`` every key after the first miss is a miss."""
        ...

    def exists(self, keys: list[bytes]) -> list[bool]:
        ...

    def entries(self, limit: int) -> list[CacheEntry]:
        """Blocks held, most recently used first."""
        ...

    def prune(self, fingerprint: str = "", tier: str = "") -> tuple[int, int]:
        """Remove blocks (of one fingerprint, from one tier); returns (blocks, bytes) removed."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters named as the fields of ``CacheStats``."""
        ...

    def close(self) -> None:
        ...


class MemoryStore:
    """The RAM tier: an LRU of payloads bounded by ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, spill: Spill | None = None):
        self.capacity = capacity_bytes
        self.spill = spill
        self.blocks: OrderedDict[bytes, tuple[bytes, BlockMeta | None]] = OrderedDict()
        self.bytes_used = 0
        self.counters = {"hits": 0, "misses": 0, "evictions": 0, "puts": 0, "rejected": 0, "corrupt": 0}

    def put(self, keys: list[bytes], values: list[bytes], meta: BlockMeta | None = None) -> int:
        if len(keys) != len(values):
            raise ValueError(f"put: {len(keys)} keys but {len(values)} values")
        stored = 0
        for key, value in zip(keys, values):
            if meta is not None and len(value) != meta.nbytes:
                self.counters["rejected"] += 1
            elif self.writable(key) and self.insert(key, value, meta):
                stored += 1
        self.counters["puts"] += stored
        return stored

    def writable(self, key: bytes) -> bool:
        """Whether a put may store ``key`` now (any key, here)."""
        return True

    def insert(self, key: bytes, value: bytes, meta: BlockMeta | None) -> bool:
        if len(value) > self.capacity:
            return False
        self.pop(key)
        while self.bytes_used + len(value) > self.capacity:
            old_key, (evicted, old_meta) = self.blocks.popitem(last=False)
            self.bytes_used -= len(evicted)
            self.counters["evictions"] += 1
            if self.spill is not None:
                self.spill(old_key, evicted, old_meta)
        self.blocks[key] = (value, meta)
        self.bytes_used += len(value)
        return True

    def pop(self, key: bytes) -> tuple[bytes, BlockMeta | None] | None:
        old = self.blocks.pop(key, None)
        if old is not None:
            self.bytes_used -= len(old[0])
        return old

    def lookup(self, key: bytes, meta: BlockMeta | None) -> bytes | None:
        """One block without touching hit/miss counters (``rejected`` counts a layout mismatch)."""
        item = self.blocks.get(key)
        if item is None:
            return None
        if not matches(item[1], meta):
            self.counters["rejected"] += 1
            return None
        self.blocks.move_to_end(key)
        return item[0]

    def get(self, keys: list[bytes], meta: BlockMeta | None = None, prefix: bool = False) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            value = None if prefix and out and out[-1] is None else self.lookup(key, meta)
            self.counters["hits" if value is not None else "misses"] += 1
            out.append(value)
        return out

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [key in self.blocks for key in keys]

    def items(self):
        """(key, payload, meta) of every block, least recently used first."""
        for key, (value, meta) in list(self.blocks.items()):
            yield key, value, meta

    def entries(self, limit: int) -> list[CacheEntry]:
        out = []
        for key in reversed(self.blocks):
            if len(out) >= limit:
                break
            value, meta = self.blocks[key]
            out.append(CacheEntry(key=key.hex(), tier="ram", nbytes=len(value), meta=meta))
        return out

    def prune(self, fingerprint: str = "", tier: str = "") -> tuple[int, int]:
        if tier not in ("", "ram"):
            return 0, 0
        doomed = [k for k, (_, m) in self.blocks.items() if not fingerprint or (m and m.fingerprint == fingerprint)]
        freed = sum(len(self.pop(k)[0]) for k in doomed)
        return len(doomed), freed

    def stats(self) -> dict[str, int]:
        return {"num_blocks": len(self.blocks), "bytes_used": self.bytes_used, "capacity_bytes": self.capacity,
                "ram_bytes": self.bytes_used, **self.counters}

    def close(self) -> None:
        self.blocks.clear()


def make_store(cfg: CacheConfig) -> BlockStore:
    """The store ``cache.backend`` names: memory (with a disk tier when ``disk_dir`` is set) or mooncake."""
    capacity, backend = cfg.capacity_mb * 2**20, cfg.backend
    if isinstance(backend, MooncakeCacheBackend):
        from rlcli.cache.mooncake import MooncakeStore

        return MooncakeStore.start(cfg.host, capacity, backend)
    if backend.disk_dir:
        from rlcli.cache.disk import TieredStore

        return TieredStore(capacity, backend.disk_dir, backend.disk_capacity_mb * 2**20, arena=backend.arena)
    if not backend.arena:
        return MemoryStore(capacity)
    from rlcli.cache.arena import ram_tier

    return ram_tier(capacity)
