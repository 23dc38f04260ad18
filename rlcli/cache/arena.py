"""rl-cache's RAM tier as one shared-memory arena that engines on this host read and write.

Why: kept as Python ``bytes``, every block crossed the host twice per transfer (a put into
freshly allocated pages, a get out into the requester's mailbox), both copies made by the
process that also answers every request. Here the payloads live in one /dev/shm file that
the engines map: a get answers slot offsets and the engine copies straight from the slots to
its device (or its KV blocks), a put writes straight into slots the store reserved for it.
The store moves no payload bytes on those paths.

Layout: one file of the store's capacity (``rlcli-arena-*``: never accepted as a request's
payload file; one a killed store left behind is removed by the next store on the host),
faulted in at start, split into units
(:data:`UNIT_BYTES`, smaller on small stores). A size class (one block size: the blocks of one
model all have one) takes a slab of one or more contiguous free units and carves it into slots
of exactly its block size, back to back; slots are handed out lowest address first, so blocks
reserved together are usually contiguous and move in one copy. A slab whose last slot frees
gives its units back.

Leases: the slots a get answered are leased to the requester until it releases them (or
``lease_s`` passes): neither evicted nor reused meanwhile, even if their block is replaced or
pruned. A put first reserves slots (keys held or being written are skipped), the requester
fills them and commits; an uncommitted reservation is taken back after ``lease_s``. Eviction
takes the least recently used block nobody leases (of the same size first; spilled to the disk
tier when there is one). When every slot is leased a reservation is refused (``refused``),
never waited for. Requesters give up a lease held longer than half of ``lease_s``, so a slot
taken back is never read or written by its old holder.

Integrity and layout rules are the :class:`~rlcli.cache.store.MemoryStore`'s. Every method
runs under the caller's lock (rl-cache's service lock); only the compatibility paths
(:meth:`ArenaStore.put` and :meth:`ArenaStore.get` with inline bytes) copy payloads here.
"""

import bisect
import heapq
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from rlcli.cache.store import MemoryStore, Spill, matches
from rlcli.logging import setup_logging
from rlcli.protocol import BlockMeta, CacheEntry
from rlcli.transport import shm

log = setup_logging("rl-cache")
UNIT_BYTES = 64 << 20
"""Bytes of one arena unit (stores under 1 GiB use a sixteenth of their capacity)."""
LEASE_S = 60.0
"""Seconds a get's lease or a put's reservation holds its slots unless released or committed."""


@dataclass(eq=False)  # slabs are told apart by identity
class _Slab:
    start: int  # byte offset in the arena
    units: int
    nbytes: int  # slot size
    free: list[int] = field(default_factory=list)  # heap of free slot offsets
    used: int = 0  # slots handed out (blocks, leased or reserved)


class ArenaStore:
    """An LRU of blocks in arena slots, bounded by the arena; implements
    :class:`~rlcli.cache.store.BlockStore`, plus leases and reservations (module docstring).
    OSError when /dev/shm has no room for ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, spill: Spill | None = None, lease_s: float = LEASE_S):
        self.spill, self.lease_s = spill, lease_s
        self.box = shm.Arena(capacity_bytes)  # created, mapped and faulted in now
        self.array, self.name, self.capacity = self.box.array, self.box.name, capacity_bytes
        self.unit = min(UNIT_BYTES, max(4096, capacity_bytes // 16 // 4096 * 4096))
        self.units: list[_Slab | None] = [None] * (capacity_bytes // self.unit)
        self.classes: dict[int, list[_Slab]] = {}  # slot size -> its slabs, by address
        self.blocks: OrderedDict[bytes, tuple[int, int, BlockMeta | None]] = OrderedDict()  # key -> offset, size, meta
        self.owner: dict[int, bytes] = {}  # slot offset -> key of the block in it
        self.pins: dict[int, int] = {}  # slot offset -> leases and reservations holding it
        self.leases: dict[int, tuple[float, list[int]]] = {}  # id -> deadline, slots
        self.reservations: dict[int, tuple[float, list[bytes], list[int], BlockMeta]] = {}
        self.reserved: set[bytes] = set()  # keys being written
        self.ids = itertools.count(1)
        self.bytes_used = 0
        self.counters = {"hits": 0, "misses": 0, "evictions": 0, "puts": 0, "rejected": 0, "corrupt": 0,
                         "refused": 0}

    @property
    def arena(self) -> "ArenaStore":
        return self

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset:offset + nbytes]

    # -- slots
    def _alloc(self, nbytes: int) -> int | None:
        if not 0 < nbytes <= self.unit * len(self.units):
            return None  # (never fits: evict nothing for it)
        while True:
            for slab in self.classes.get(nbytes, ()):
                if slab.free:
                    slab.used += 1
                    return heapq.heappop(slab.free)
            if not (self._grow(nbytes) or self._evict(nbytes) or self.expire()):
                return None

    def _grow(self, nbytes: int) -> bool:
        """Carve a slab for slots of ``nbytes`` out of the lowest free units that hold one."""
        k, run = -(-nbytes // self.unit), 0
        for i, slab in enumerate(self.units):
            run = run + 1 if slab is None else 0
            if run == k:
                start = (i - k + 1) * self.unit
                slab = _Slab(start, k, nbytes, list(range(start, start + k * self.unit // nbytes * nbytes, nbytes)))
                self.units[i - k + 1:i + 1] = [slab] * k
                bisect.insort(self.classes.setdefault(nbytes, []), slab, key=lambda s: s.start)
                return True
        return False

    def _free(self, offset: int) -> None:
        """Hand a slot back once no block, lease or reservation holds it."""
        if offset in self.owner or offset in self.pins:
            return
        slab = self.units[offset // self.unit]
        heapq.heappush(slab.free, offset)
        slab.used -= 1
        if not slab.used:  # its units go back to the arena
            self.classes[slab.nbytes].remove(slab)
            first = slab.start // self.unit
            self.units[first:first + slab.units] = [None] * slab.units

    def _new_id(self) -> int:
        return next(self.ids)

    def _unpin(self, offsets: list[int]) -> None:
        for o in offsets:
            if self.pins[o] == 1:
                del self.pins[o]
            else:
                self.pins[o] -= 1
            self._free(o)

    def _evict(self, nbytes: int) -> bool:
        """Evict the least recently used block whose slot nobody leases (one of ``nbytes`` first)."""
        victim = None
        for key, (o, n, _) in self.blocks.items():
            if o not in self.pins:
                victim = victim or key
                if n == nbytes:
                    victim = key
                    break
        if victim is None:
            return False
        offset, n, meta = self.blocks[victim]
        if self.spill is not None:
            self.spill(victim, self.view(offset, n).tobytes(), meta)
        self._drop(victim)
        self.counters["evictions"] += 1
        return True

    def _drop(self, key: bytes) -> int:
        item = self.blocks.pop(key, None)
        if item is None:
            return 0
        del self.owner[item[0]]
        self.bytes_used -= item[1]
        self._free(item[0])
        return item[1]

    def _place(self, key: bytes, offset: int, nbytes: int, meta: BlockMeta | None) -> None:
        self._drop(key)
        self.blocks[key] = (offset, nbytes, meta)
        self.owner[offset] = key
        self.bytes_used += nbytes

    # -- the BlockStore interface (payloads as bytes: inline requests, the disk tier)
    def insert(self, key: bytes, value: bytes, meta: BlockMeta | None) -> bool:
        offset = self._alloc(len(value))
        if offset is None:
            self.counters["refused"] += 1
            return False
        self.view(offset, len(value))[:] = np.frombuffer(value, dtype=np.uint8)
        self._place(key, offset, len(value), meta)
        return True

    def put(self, keys: list[bytes], values: list[bytes], meta: BlockMeta | None = None) -> int:
        return MemoryStore.put(self, keys, values, meta)

    def writable(self, key: bytes) -> bool:
        """Not a key being written through a reservation (it will be there)."""
        return key not in self.reserved

    def _find(self, key: bytes, meta: BlockMeta | None) -> tuple[int, int] | None:
        item = self.blocks.get(key)
        if item is None:
            return None
        if not matches(item[2], meta):
            self.counters["rejected"] += 1
            return None
        self.blocks.move_to_end(key)
        return item[0], item[1]

    def lookup(self, key: bytes, meta: BlockMeta | None) -> bytes | None:
        found = self._find(key, meta)
        return None if found is None else self.view(*found).tobytes()

    def get(self, keys: list[bytes], meta: BlockMeta | None = None, prefix: bool = False) -> list[bytes | None]:
        return MemoryStore.get(self, keys, meta, prefix)

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [k in self.blocks or k in self.reserved for k in keys]

    # -- leases and reservations
    def lease(self, keys: list[bytes], meta: BlockMeta | None = None, prefix: bool = False) -> tuple[int, list]:
        """(lease, slot offset per key, None for a miss); lease 0 when nothing was found."""
        out: list[int | None] = []
        for key in keys:
            found = None if prefix and out and out[-1] is None else self._find(key, meta)
            self.counters["hits" if found is not None else "misses"] += 1
            out.append(None if found is None else found[0])
        held = [o for o in out if o is not None]
        if not held:
            return 0, out
        for o in held:
            self.pins[o] = self.pins.get(o, 0) + 1
        self.leases[lease := self._new_id()] = (time.monotonic() + self.lease_s, held)
        return lease, out

    def reserve(self, keys: list[bytes], meta: BlockMeta,
                present: Callable[[bytes], bool] | None = None) -> tuple[int, list[int]]:
        """(reservation, per key the slot to write, -1 held or being written, -2 no room)."""
        offsets, mine, slots = [], [], []
        for key in keys:
            if key in self.blocks or key in self.reserved or (present is not None and present(key)):
                offsets.append(-1)
            elif (o := self._alloc(meta.nbytes)) is None:
                self.counters["refused"] += 1
                offsets.append(-2)
            else:
                self.pins[o] = 1  # a free slot: now held by this reservation
                self.reserved.add(key)
                offsets.append(o)
                mine.append(key)
                slots.append(o)
        if not mine:
            return 0, offsets
        self.reservations[lease := self._new_id()] = (time.monotonic() + self.lease_s, mine, slots, meta)
        return lease, offsets

    def commit(self, lease: int, keys: list[bytes]) -> int:
        """The reservation's blocks are written: store them under their keys."""
        item = self.reservations.pop(lease, None)
        if item is None:
            raise ValueError(f"no reservation {lease} (expired, or committed already)")
        _, mine, slots, meta = item
        self.reserved.difference_update(mine)
        if keys == mine:
            for key, o in zip(mine, slots):
                self._place(key, o, meta.nbytes, meta)
            self.counters["puts"] += len(mine)
        self._unpin(slots)
        if keys != mine:
            raise ValueError(f"commit of reservation {lease} names other keys than it reserved")
        return len(mine)

    def release(self, lease: int) -> bool:
        """End a get's lease, or abandon a reservation; False if there is none (expired)."""
        if (item := self.leases.pop(lease, None)) is not None:
            self._unpin(item[1])
            return True
        if (res := self.reservations.pop(lease, None)) is not None:
            self.reserved.difference_update(res[1])
            self._unpin(res[2])
            return True
        return False

    def expire(self) -> int:
        """Take back leases and reservations past their deadline; returns how many."""
        now = time.monotonic()
        old = [k for held in (self.leases, self.reservations) for k, v in held.items() if v[0] < now]
        for lease in old:
            self.release(lease)
        return len(old)

    # -- listing, pruning, stats
    def items(self) -> Iterator[tuple[bytes, bytes, BlockMeta | None]]:
        for key, (o, n, meta) in list(self.blocks.items()):
            yield key, self.view(o, n).tobytes(), meta

    def entries(self, limit: int) -> list[CacheEntry]:
        return [CacheEntry(key=k.hex(), tier="ram", nbytes=self.blocks[k][1], meta=self.blocks[k][2])
                for k in itertools.islice(reversed(self.blocks), max(0, limit))]

    def prune(self, fingerprint: str = "", tier: str = "") -> tuple[int, int]:
        if tier not in ("", "ram"):
            return 0, 0
        doomed = [k for k, (_, _, m) in self.blocks.items() if not fingerprint or (m and m.fingerprint == fingerprint)]
        return len(doomed), sum(self._drop(k) for k in doomed)

    def stats(self) -> dict:
        return {"num_blocks": len(self.blocks), "bytes_used": self.bytes_used, "capacity_bytes": self.capacity,
                "ram_bytes": self.bytes_used, "leased": len(self.pins), "arena": self.name, **self.counters}

    def close(self) -> None:
        self.blocks.clear()
        self.array = np.empty(0, dtype=np.uint8)
        self.box.close()


def ram_tier(capacity_bytes: int, spill: Spill | None = None) -> "ArenaStore | MemoryStore":
    """The memory backend's RAM tier: an arena in /dev/shm, or, where /dev/shm lacks the room
    (containers often mount 64 MiB), an LRU of bytes that engines reach through copies."""
    if shm.available(capacity_bytes + (64 << 20)):
        try:
            store = ArenaStore(capacity_bytes, spill)
            log.info("RAM tier: shared arena /dev/shm/%s (%d MiB, slabs of %d KiB)", store.name,
                     capacity_bytes >> 20, store.unit >> 10)
            return store
        except OSError as e:
            log.warning("no shared-memory arena (%s): RAM tier kept as bytes", e)
    else:
        log.warning("/dev/shm has no room for a %d MiB arena: RAM tier kept as bytes", capacity_bytes >> 20)
    return MemoryStore(capacity_bytes, spill)
