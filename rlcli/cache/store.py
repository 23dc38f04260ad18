"""Block stores: opaque values (KV blocks) under content-hash keys.

A store is a small interface (:class:`BlockStore`); :func:`make_store` picks the backend
named by ``cache.backend``. The embedded :class:`MemoryStore` is a byte-bounded LRU:
a put that would exceed the capacity evicts the least recently used blocks first, and a
single block larger than the whole capacity is refused.
"""

from collections import OrderedDict
from typing import Protocol

from rlcli.config.services import CacheConfig


class BlockStore(Protocol):
    def put(self, keys: list[bytes], values: list[bytes]) -> int: ...

    def get(self, keys: list[bytes]) -> list[bytes | None]: ...

    def exists(self, keys: list[bytes]) -> list[bool]: ...

    def stats(self) -> dict[str, int]: ...


class MemoryStore:
    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self.bytes_used = 0
        self.counters = {"hits": 0, "misses": 0, "evictions": 0, "puts": 0}

    def put(self, keys: list[bytes], values: list[bytes]) -> int:
        if len(keys) != len(values):
            raise ValueError(f"put: {len(keys)} keys but {len(values)} values")
        stored = 0
        for key, value in zip(keys, values):
            if len(value) > self.capacity:
                continue
            old = self.blocks.pop(key, None)
            if old is not None:
                self.bytes_used -= len(old)
            while self.bytes_used + len(value) > self.capacity:
                _, evicted = self.blocks.popitem(last=False)
                self.bytes_used -= len(evicted)
                self.counters["evictions"] += 1
            self.blocks[key] = value
            self.bytes_used += len(value)
            stored += 1
        self.counters["puts"] += stored
        return stored

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        out = []
        for key in keys:
            value = self.blocks.get(key)
            if value is None:
                self.counters["misses"] += 1
            else:
                self.blocks.move_to_end(key)
                self.counters["hits"] += 1
            out.append(value)
        return out

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [key in self.blocks for key in keys]

    def stats(self) -> dict[str, int]:
        return {"num_blocks": len(self.blocks), "bytes_used": self.bytes_used, "capacity_bytes": self.capacity,
                **self.counters}


def make_store(cfg: CacheConfig) -> BlockStore:
    if cfg.backend == "memory":
        return MemoryStore(cfg.capacity_mb * 2**20)
    raise ValueError(f"unknown cache.backend {cfg.backend!r}")
