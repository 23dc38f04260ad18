"""KV payloads between processes of one host through files in /dev/shm.

ZeroMQ carries keys and metadata; a batch of block payloads lies back to back in one
file on the RAM-backed /dev/shm, named in the message. The writer creates the file under
a temporary name and renames it, so a reader never sees half of it. Who deletes it is
part of each message's contract (rl-cache: the requester deletes the files it sent once
answered, and the files it was answered with once read). Names are checked against
:data:`NAME_RE`, so a message can never make a process read or delete another path.

A :class:`Mailbox` is such a file kept by one process and reused for every transfer,
mapped into its memory: its pages are faulted in once (fresh pages cost more than the
copy itself), the peer reads or writes it with one copy, and its owner can register the
mapping with CUDA so the device reads and writes it directly.
"""

import fcntl
import mmap
import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

SHM_DIR = Path(os.environ.get("RLCLI_SHM_DIR", "/dev/shm"))
NAME_RE = re.compile(r"rlcli-kv-[0-9a-f]{32}")
ARENA_RE = re.compile(r"rlcli-arena-[0-9a-f]{32}")
"""rl-cache's arena files: never a payload file (a request naming one as its file is refused)."""
PARALLEL_BYTES = 32 << 20
"""Fewest bytes per thread of a parallel :func:`write_into`."""


def available(min_free_bytes: int = 1 << 30) -> bool:
    """Whether this host has a writable shared-memory directory with ``min_free_bytes`` free
    (containers often mount a 64 MiB /dev/shm)."""
    if not (SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)):
        return False
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize >= min_free_bytes


def path_of(name: str) -> Path:
    """The file of a payload name from a message; ValueError for anything not ours."""
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"not an rlcli shared-memory payload name: {name[:80]!r}")
    return SHM_DIR / name


def write_payloads(payloads: Iterable[bytes | memoryview]) -> str:
    """Write payloads back to back into a new file; returns its name."""
    name = f"rlcli-kv-{uuid.uuid4().hex}"
    tmp = SHM_DIR / f".{name}.tmp"
    try:
        with open(tmp, "wb") as f:
            for p in payloads:
                f.write(p)
        os.replace(tmp, SHM_DIR / name)
    except BaseException:
        tmp.unlink(missing_ok=True)  # /dev/shm is RAM: a payload cut short (full, interrupted) is freed
        raise
    return name


def read_payloads(name: str, nbytes: int, count: int, threads: int = 1) -> list[bytes]:
    """The first ``count`` payloads of ``nbytes`` each (one copy each, split over ``threads``
    when large); ValueError if the file is smaller (a requester's reused :class:`Mailbox` may
    be larger)."""
    path = path_of(name)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size < nbytes * count:
                raise ValueError(f"shared-memory payload {name} holds {size} bytes, expected {count} x {nbytes}")
            fd = f.fileno()

            def read(lo: int, hi: int) -> list[bytes]:  # pread copies without the GIL
                return [os.pread(fd, nbytes, i * nbytes) for i in range(lo, hi)]

            parts = min(threads, count, max(1, nbytes * count // PARALLEL_BYTES))
            if parts <= 1:
                out = read(0, count)
            else:
                bounds = [count * k // parts for k in range(parts + 1)]
                with ThreadPoolExecutor(parts) as pool:
                    out = [p for chunk in pool.map(read, bounds[:-1], bounds[1:]) for p in chunk]
    except FileNotFoundError:
        raise ValueError(f"shared-memory payload {name} does not exist") from None
    if any(len(p) != nbytes for p in out):
        raise ValueError(f"shared-memory payload {name} was cut short while read")
    return out


def write_into(name: str, payloads: list[bytes | memoryview], threads: int = 1) -> None:
    """Write payloads back to back from the start of an existing file (a requester's
    :class:`Mailbox`: its pages are already in memory, so this is one copy, split over
    ``threads`` when large); ValueError if the file does not exist or is too small."""
    offsets = [0]
    for p in payloads:
        offsets.append(offsets[-1] + len(p))
    total = offsets[-1]
    try:
        with open(path_of(name), "r+b", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size < total:
                raise ValueError(f"shared-memory file {name} holds {size} bytes, {total} needed")
            if not total:
                return
            with mmap.mmap(f.fileno(), total) as mm:
                dst = np.frombuffer(mm, dtype=np.uint8)

                def copy(lo: int, hi: int) -> None:  # numpy copies without the GIL
                    for i in range(lo, hi):
                        dst[offsets[i]:offsets[i + 1]] = np.frombuffer(payloads[i], dtype=np.uint8)

                parts = min(threads, len(payloads), max(1, total // PARALLEL_BYTES))
                if parts <= 1:
                    copy(0, len(payloads))
                else:
                    bounds = [len(payloads) * k // parts for k in range(parts + 1)]
                    with ThreadPoolExecutor(parts) as pool:
                        list(pool.map(copy, bounds[:-1], bounds[1:]))
                del dst
    except FileNotFoundError:
        raise ValueError(f"shared-memory file {name} does not exist") from None


def read_into(name: str, out: memoryview) -> int:
    """Read the whole file of a payload name into ``out`` (a writable byte buffer at least as
    large: a pinned staging tensor, so the bytes cross once); returns its size. ValueError if
    the file does not exist or does not fit."""
    try:
        with open(path_of(name), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size > len(out):
                raise ValueError(f"shared-memory payload {name} holds {size} bytes, expected at most {len(out)}")
            got = 0
            while got < size:
                k = f.readinto(out[got:size])
                if not k:
                    raise ValueError(f"shared-memory payload {name} ended after {got} of {size} bytes")
                got += k
            return size
    except FileNotFoundError:
        raise ValueError(f"shared-memory payload {name} does not exist") from None


def remove(name: str) -> None:
    try:
        path_of(name).unlink()
    except (FileNotFoundError, ValueError):
        pass


class _Mapped:
    """A mapped /dev/shm file: ``_mm`` (None once unmapped), its bytes as ``array``."""

    _mm: mmap.mmap | None = None
    on_unmap: Callable[[np.ndarray], None] | None = None

    def _unmap(self) -> bool:
        """Run ``on_unmap``, drop ``array`` and the mapping; False when there was none."""
        if self._mm is None:
            return False
        if self.on_unmap is not None:
            self.on_unmap(self.array)
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._mm.close()
        except BufferError:  # a view still lives somewhere: the mapping goes when it does
            pass
        self._mm = None
        return True


class Mailbox(_Mapped):
    """A reusable payload file in /dev/shm, mapped here and grown on demand (its owner deletes it).

    ``on_map(array)`` / ``on_unmap(array)`` run when a mapping is made or dropped (a CUDA
    engine registers it as pinned memory there)."""

    def __init__(self, on_map: Callable[[np.ndarray], None] | None = None,
                 on_unmap: Callable[[np.ndarray], None] | None = None):
        self.on_map, self.on_unmap = on_map, on_unmap
        self.name = ""
        self.size = 0
        self._mm: mmap.mmap | None = None
        self.array = np.empty(0, dtype=np.uint8)

    def view(self, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of the mapping (growing the file first when it is smaller;
        OSError when /dev/shm has no room for it)."""
        if nbytes > self.size:
            self._map(max(nbytes, 2 * self.size))
        return self.array[:nbytes]

    def _map(self, size: int) -> None:
        self.close()
        name = f"rlcli-kv-{uuid.uuid4().hex}"
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # OSError (no space) now, not SIGBUS on first touch
            self._mm = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            remove(name)
            raise
        os.close(fd)
        self.name, self.size = name, size
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.array[:] = 0  # fault every page in now, not during a transfer
        if self.on_map is not None:
            self.on_map(self.array)

    def close(self) -> None:
        if self._unmap():
            remove(self.name)
            self.name, self.size = "", 0


def arena_path_of(name: str) -> Path:
    """The file of an arena name from a message; ValueError for anything else."""
    if not ARENA_RE.fullmatch(name):
        raise ValueError(f"not an rlcli shared-memory arena name: {name[:80]!r}")
    return SHM_DIR / name


def remove_stale_arenas() -> int:
    """Remove arena files whose owner died without removing them (no process holds their lock);
    returns how many."""
    removed = 0
    for path in SHM_DIR.glob("rlcli-arena-*"):
        if not ARENA_RE.fullmatch(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # granted only when no owner holds it
            path.unlink(missing_ok=True)
            removed += 1
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    return removed


class Arena(_Mapped):
    """A /dev/shm file of ``size`` bytes that this process owns (rl-cache's RAM tier), mapped and
    faulted in. Its owner holds a shared ``flock`` on it while alive, so the next owner on the
    host removes one whose process died (SIGKILL) instead of leaving its memory taken. OSError
    when /dev/shm has no room."""

    def __init__(self, size: int):
        remove_stale_arenas()
        self.name = f"rlcli-arena-{uuid.uuid4().hex}"
        tmp = SHM_DIR / f".{self.name}.tmp"  # (locked before a stale-arena scan can see it)
        self._fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            os.posix_fallocate(self._fd, 0, size)  # OSError (no space) now, not SIGBUS on first touch
            self._mm = mmap.mmap(self._fd, size)
            os.replace(tmp, SHM_DIR / self.name)
        except OSError:
            os.close(self._fd)
            tmp.unlink(missing_ok=True)
            raise
        self.size = size
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.array[:] = 0  # fault every page in now, not during a transfer

    def close(self) -> None:
        if self._fd < 0:
            return
        self._unmap()
        (SHM_DIR / self.name).unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1


class Mapping(_Mapped):
    """Another process's /dev/shm file (rl-cache's arena) mapped whole, read-write, here.

    The pages are populated at map time (they are already in memory: the owner faulted them
    in), so no transfer takes page faults; ``on_map`` / ``on_unmap`` as for :class:`Mailbox`.
    ValueError for a name that is not an arena's or a file that does not exist."""

    def __init__(self, name: str, on_map: Callable[[np.ndarray], None] | None = None,
                 on_unmap: Callable[[np.ndarray], None] | None = None):
        path = arena_path_of(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ValueError(f"shared-memory file {name} does not exist") from None
        try:
            self.size = os.fstat(fd).st_size
            if not self.size:
                raise ValueError(f"shared-memory file {name} is empty")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, self.size, flags=flags)
        finally:
            os.close(fd)
        self.name, self.on_unmap = name, on_unmap
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        if on_map is not None:
            on_map(self.array)

    def alive(self) -> bool:
        """Whether the file is still there (its owner removes it when it exits)."""
        return arena_path_of(self.name).exists()

    def close(self) -> None:
        self._unmap()
