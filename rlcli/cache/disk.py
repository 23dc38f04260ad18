"""The disk tier under the RAM tier: blocks the RAM LRU evicts are written here.

One file per block, ``<dir>/<key[:2]>/<key>.kv``: a header (magic, the block's layout, its
payload length and BLAKE2b digest) and the payload. Files are written under a temporary
name and renamed, so a reader sees a whole file or none; they are not fsynced (this is a
cache: a block torn by a crash fails its digest). Every read checks the length and the
digest; a block that fails is deleted, counted as ``corrupt`` and answered as a miss,
never served. The tier has its own byte capacity and LRU order (rebuilt from the files'
modification times at start, so a restarted store serves what it held).
"""

import hashlib
import os
import struct
from collections import OrderedDict
from pathlib import Path

import msgspec

from rlcli.cache.store import MemoryStore, matches
from rlcli.protocol import BlockMeta, CacheEntry

MAGIC = b"RLKVBLK1"


class _Header(msgspec.Struct, array_like=True):
    meta: BlockMeta | None
    nbytes: int
    digest: bytes


_encode = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(_Header).decode


def digest(value: bytes) -> bytes:
    return hashlib.blake2b(value, digest_size=16).digest()


def _hold(root: Path):
    """An exclusive lock on ``root/.lock`` for this process's lifetime (the open file is returned and
    kept); a directory another live store holds is a ConfigError naming --disk-dir."""
    import fcntl

    from rlcli.errors import ConfigError

    f = open(root / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise ConfigError(f"disk tier {root} is in use by another rl-cache; give each store its own --disk-dir "
                          "(cache.backend.disk_dir)") from None
    return f


class DiskStore:
    """Blocks as checksummed files, LRU-bounded by ``capacity_bytes``."""

    def __init__(self, root: str | Path, capacity_bytes: int):
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            from rlcli.errors import ConfigError

            raise ConfigError(f"cannot use {root} as the disk tier ({e.strerror}); pass another --disk-dir "
                              "(cache.backend.disk_dir)") from None
        self._lock = _hold(self.root)  # one store per directory: its index and capacity are the files'
        self.capacity = capacity_bytes
        self.index: OrderedDict[bytes, tuple[int, BlockMeta | None]] = OrderedDict()  # key -> (nbytes, meta)
        self.bytes_used = 0
        self.num_evictions = 0
        self.num_corrupt = 0
        self._scan()

    def close(self) -> None:
        """Release the directory's lock (another store may take it)."""
        self._lock.close()

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / f"{h}.kv"

    def _scan(self) -> None:
        for tmp in self.root.glob("*/.*.kv.tmp-*"):  # a write a crash interrupted
            tmp.unlink(missing_ok=True)
        found = []
        for path in self.root.glob("*/*.kv"):
            try:
                key = bytes.fromhex(path.stem)
                with open(path, "rb") as f:
                    header = self._read_header(f)
                found.append((path.stat().st_mtime, key, header))
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
        for _, key, header in sorted(found, key=lambda t: t[0]):
            self.index[key] = (header.nbytes, header.meta)
            self.bytes_used += header.nbytes

    @staticmethod
    def _read_header(f) -> _Header:
        head = f.read(len(MAGIC) + 4)
        if len(head) != len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
            raise ValueError("not a block file")
        (size,) = struct.unpack("<I", head[len(MAGIC):])
        try:
            return _decode_header(f.read(size))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"bad block header: {e}") from None

    def write(self, key: bytes, value: bytes, meta: BlockMeta | None) -> bool:
        if len(value) > self.capacity:
            return False
        if key in self.index:
            self.index.move_to_end(key)
            return True
        while self.bytes_used + len(value) > self.capacity:
            old, (nbytes, _) = self.index.popitem(last=False)
            self.bytes_used -= nbytes
            self._unlink(old)
            self.num_evictions += 1
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        header = _encode(_Header(meta, len(value), digest(value)))
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header)
                f.write(value)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk leaves no torn temporary behind
            raise
        self.index[key] = (len(value), meta)
        self.bytes_used += len(value)
        return True

    def read(self, key: bytes, meta: BlockMeta | None) -> tuple[bytes | None, bool]:
        """(payload, layout matched); the payload is None on a miss, a mismatch or corruption."""
        item = self.index.get(key)
        if item is None:
            return None, True
        if not matches(item[1], meta):
            return None, False
        try:
            with open(self._path(key), "rb") as f:
                header = self._read_header(f)
                value = f.read()
            ok = header.nbytes == len(value) == item[0] and digest(value) == header.digest and header.meta == item[1]
        except (OSError, ValueError):
            ok = False
        if not ok:
            self.drop(key)
            self.num_corrupt += 1
            return None, True
        self.index.move_to_end(key)
        return value, True

    def _unlink(self, key: bytes) -> None:
        self._path(key).unlink(missing_ok=True)

    def drop(self, key: bytes) -> int:
        item = self.index.pop(key, None)
        if item is None:
            return 0
        self.bytes_used -= item[0]
        self._unlink(key)
        return item[0]


class TieredStore:
    """RAM tier over a disk tier; implements :class:`rlcli.cache.store.BlockStore`.

    Puts go to RAM; RAM evictions are written to disk (``evictions`` counts blocks leaving
    either tier). A get reads RAM, then disk, and moves a disk hit back into RAM."""

    def __init__(self, ram_capacity_bytes: int, disk_dir: str | Path, disk_capacity_bytes: int, arena: bool = False):
        self.disk = DiskStore(disk_dir, disk_capacity_bytes)
        if arena:  # a shared-memory arena where /dev/shm has the room
            from rlcli.cache.arena import ram_tier

            self.ram = ram_tier(ram_capacity_bytes, spill=self.disk.write)
        else:
            self.ram = MemoryStore(ram_capacity_bytes, spill=self.disk.write)
        self.arena = getattr(self.ram, "arena", None)

    def put(self, keys: list[bytes], values: list[bytes], meta: BlockMeta | None = None) -> int:
        return self.ram.put(keys, values, meta)

    def get(self, keys: list[bytes], meta: BlockMeta | None = None, prefix: bool = False) -> list[bytes | None]:
        out: list[bytes | None] = []
        counters = self.ram.counters
        for key in keys:
            value = None
            if not (prefix and out and out[-1] is None):
                value = self.ram.lookup(key, meta)
                if value is None and key not in self.ram.blocks:
                    value, matched = self.disk.read(key, meta)
                    counters["rejected"] += not matched
                    if value is not None:
                        self.ram.insert(key, value, self.disk.index[key][1])
            counters["hits" if value is not None else "misses"] += 1
            out.append(value)
        return out

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [e or k in self.disk.index for k, e in zip(keys, self.ram.exists(keys))]

    def lease(self, keys: list[bytes], meta: BlockMeta | None = None, prefix: bool = False) -> tuple[int, list]:
        """The arena's lease (:meth:`ArenaStore.lease`), disk hits moved up into RAM first."""
        for key in keys:
            if key not in self.ram.blocks and key in self.disk.index:
                value, matched = self.disk.read(key, meta)
                self.ram.counters["rejected"] += not matched
                if value is not None and self.ram.insert(key, value, self.disk.index[key][1]):
                    continue
            if prefix and key not in self.ram.blocks:
                break
        return self.ram.lease(keys, meta, prefix)

    def reserve(self, keys: list[bytes], meta: BlockMeta) -> tuple[int, list[int]]:
        return self.ram.reserve(keys, meta, present=self.disk.index.__contains__)

    def commit(self, lease: int, keys: list[bytes]) -> int:
        return self.ram.commit(lease, keys)

    def release(self, lease: int) -> bool:
        return self.ram.release(lease)

    def expire(self) -> int:
        return self.ram.expire()

    def entries(self, limit: int) -> list[CacheEntry]:
        out = self.ram.entries(limit)
        for key in reversed(self.disk.index):
            if len(out) >= limit:
                break
            if key not in self.ram.blocks:
                nbytes, meta = self.disk.index[key]
                out.append(CacheEntry(key=key.hex(), tier="disk", nbytes=nbytes, meta=meta))
        return out

    def prune(self, fingerprint: str = "", tier: str = "") -> tuple[int, int]:
        removed, freed = self.ram.prune(fingerprint, tier)
        if tier in ("", "disk"):
            doomed = [k for k, (_, m) in self.disk.index.items()
                      if not fingerprint or (m and m.fingerprint == fingerprint)]
            removed += len(doomed)
            freed += sum(self.disk.drop(k) for k in doomed)
        return removed, freed

    def stats(self) -> dict[str, int]:
        s = self.ram.stats()
        only_disk = sum(1 for k in self.disk.index if k not in self.ram.blocks)
        return {**s, "num_blocks": s["num_blocks"] + only_disk,
                "bytes_used": self.ram.bytes_used + self.disk.bytes_used,
                "capacity_bytes": self.ram.capacity + self.disk.capacity,
                "evictions": s["evictions"] + self.disk.num_evictions, "corrupt": self.disk.num_corrupt,
                "disk_bytes": self.disk.bytes_used, "disk_blocks": len(self.disk.index)}

    def close(self) -> None:
        # RAM contents go down to disk, so a restarted store serves them.
        try:
            for key, value, meta in self.ram.items():
                self.disk.write(key, value, meta)
        finally:
            self.ram.close()
            self.disk.close()
