"""KV payloads between processes of one host through files in /dev/shm.

ZeroMQ carries keys and metadata; a batch of block payloads lies back to back in one
file on the RAM-backed /dev/shm, named in the message. The writer creates the file under
a temporary name and renames it, so a reader never sees half of it. Who deletes it is
part of each message's contract (rl-cache: the requester deletes the files it sent once
answered, and the files it was answered with once read). Names are checked against
:data:`NAME_RE`, so a message can never make a process read or delete another path.
"""

import os
import re
import uuid
from pathlib import Path
from typing import Iterable

SHM_DIR = Path(os.environ.get("RLCLI_SHM_DIR", "/dev/shm"))
NAME_RE = re.compile(r"rlcli-kv-[0-9a-f]{32}")


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
    with open(tmp, "wb") as f:
        for p in payloads:
            f.write(p)
    os.replace(tmp, SHM_DIR / name)
    return name


def read_payloads(name: str, nbytes: int, count: int) -> list[bytes]:
    """``count`` payloads of ``nbytes`` each; ValueError if the file holds another amount."""
    path = path_of(name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"shared-memory payload {name} does not exist") from None
    if len(data) != nbytes * count:
        raise ValueError(f"shared-memory payload {name} holds {len(data)} bytes, expected {count} x {nbytes}")
    view = memoryview(data)
    return [bytes(view[i * nbytes:(i + 1) * nbytes]) for i in range(count)]


def read_all(name: str) -> bytes:
    """The whole file of a payload name (ValueError if it does not exist)."""
    try:
        return path_of(name).read_bytes()
    except FileNotFoundError:
        raise ValueError(f"shared-memory payload {name} does not exist") from None


def remove(name: str) -> None:
    try:
        path_of(name).unlink()
    except (FileNotFoundError, ValueError):
        pass
