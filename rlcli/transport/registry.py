"""Endpoint registry: RUN/registry/<role>-<id>.json, one file per live process.

Each process writes its endpoints, pid, host and an ``incarnation`` (a fresh id per
start) and rewrites the file with a new ``heartbeat`` time every few seconds. Peers
discover each other here; a heartbeat older than ``stale_after`` seconds marks the
process dead, and a changed incarnation tells a peer that the process restarted (so
its in-flight requests are lost and must be re-sent). The file is removed on clean exit.
"""

import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from rlcli.transport.atomic import atomic_write_bytes

HEARTBEAT_INTERVAL_S = 1.0
STALE_AFTER_S = 10.0


class Entry(msgspec.Struct, kw_only=True):
    role: str
    """Command: infer, train, sync, cache, orchestrate."""
    id: str
    """Instance id within the role."""
    endpoints: dict[str, str]
    """Named ZeroMQ endpoints, e.g. {"rpc": "tcp://10.0.0.3:5555"}."""
    pid: int
    """Process id on ``host``."""
    host: str
    """Hostname."""
    incarnation: str
    """Random id of this start of the process."""
    started: float
    """Unix time the process started."""
    heartbeat: float
    """Unix time of the last heartbeat."""
    info: dict[str, Any] = {}
    """Role-specific facts (served policy version, ...)."""

    def alive(self, stale_after: float = STALE_AFTER_S) -> bool:
        return time.time() - self.heartbeat < stale_after

    @property
    def key(self) -> str:
        return f"{self.role}-{self.id}"


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Entry)


class Registration:
    """This process's registry entry, kept fresh by a daemon thread."""

    def __init__(self, registry_dir: str | Path, role: str, instance: str | int, endpoints: dict[str, str],
                 info: dict[str, Any] | None = None, interval: float = HEARTBEAT_INTERVAL_S):
        now = time.time()
        self.path = Path(registry_dir) / f"{role}-{instance}.json"
        self.entry = Entry(role=role, id=str(instance), endpoints=endpoints, pid=os.getpid(),
                           host=socket.gethostname(), incarnation=uuid.uuid4().hex[:12], started=now,
                           heartbeat=now, info=dict(info or {}))
        self._interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._write()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{role}", daemon=True)
        self._thread.start()

    def update(self, **info: Any) -> None:
        """Merge ``info`` into the entry and write it now."""
        with self._lock:
            self.entry.info.update(info)
        self._write()

    def _write(self) -> None:
        with self._lock:
            self.entry.heartbeat = time.time()
            atomic_write_bytes(self.path, _encoder.encode(self.entry), fsync=False)

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._write()
            except OSError:
                pass  # the run directory may be briefly unavailable (NFS); keep beating

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            current = read_entry(self.path)
            if current is not None and current.incarnation == self.entry.incarnation:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass


def read_entry(path: str | Path) -> Entry | None:
    try:
        return _decoder.decode(Path(path).read_bytes())
    except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def list_entries(registry_dir: str | Path, role: str | None = None, alive_only: bool = True,
                 stale_after: float = STALE_AFTER_S) -> list[Entry]:
    """Entries of ``role`` (all roles if None), sorted by key; dead ones skipped if ``alive_only``."""
    registry_dir = Path(registry_dir)
    if not registry_dir.is_dir():
        return []
    out = []
    for path in sorted(registry_dir.glob(f"{role}-*.json" if role else "*.json")):
        entry = read_entry(path)
        if entry is None or (role and entry.role != role):
            continue
        if alive_only and not entry.alive(stale_after):
            continue
        out.append(entry)
    return out
