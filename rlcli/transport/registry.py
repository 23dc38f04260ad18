"""Endpoint registry: RUN/registry/<role>-<id>.json, one file per live process.

Each process writes its endpoints, pid, host and an ``incarnation`` (a fresh id per
start). Liveness comes from the process's *work loop*, not a side thread: every
iteration calls :meth:`Registration.beat`, which rewrites the file with a new
``heartbeat`` time at most every ``interval`` seconds. So a wedged loop (a hung kernel,
a deadlock, SIGSTOP) stops beating like a dead process does. Before an operation that
blocks the loop for long (a weight load, a trainer step, a checkpoint) the loop beats
with ``busy_s``: the entry promises its next beat by then, and peers wait that long.
An operation deep inside a step that the loop cannot foresee (a JIT compile on a GEMM
shape's first use) calls :func:`expect_long`, which extends the promise of the process's
registration, if it took such notices (:meth:`Registration.take_long_op_notices`).

Peers discover each other here; an entry whose heartbeat is older than ``stale_after``
seconds (and past any promised ``busy_until``) marks the process dead or stopped, and a
changed incarnation tells a peer that the process restarted (so its in-flight requests
are lost and must be re-sent). :func:`describe_gone` is the one line a peer logs when
it drops one. The file is removed on clean exit.

Two checks run when a process registers:
- one role and id is one process: an entry of another live process under the same key (on
  this host: its pid runs; on another: its heartbeat moves within a few beats) is refused;
- processes agree on the settings they share (:data:`rlcli.config.recipe.SHARED_SETTINGS`,
  registered as ``info["settings"]``): a process that finds a live peer registered before it
  with another value of one stops, naming the key (:func:`check_settings`).
"""

import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import msgspec

from rlcli.errors import ConfigError, RunDirError
from rlcli.transport.atomic import _pid_alive, atomic_write_bytes, clean_temporaries

HEARTBEAT_INTERVAL_S = 1.0
STALE_AFTER_S = float(os.environ.get("RLCLI_STALE_AFTER_S", "10"))
"""A peer silent this long is dead or stopped (RLCLI_STALE_AFTER_S; tests shorten it)."""


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
    busy_until: float = 0.0
    """Unix time by which the process promised its next beat (a long operation is running)."""

    def alive(self, stale_after: float | None = None) -> bool:
        now = time.time()
        return now - self.heartbeat < (STALE_AFTER_S if stale_after is None else stale_after) or now < self.busy_until

    def silent_s(self) -> float:
        """Seconds since the last heartbeat."""
        return time.time() - self.heartbeat

    @property
    def key(self) -> str:
        return f"{self.role}-{self.id}"


_long_op_notice: Callable[[float], None] | None = None  # the registration that takes expect_long's notices


def expect_long(seconds: float) -> None:
    """Say, from inside the work loop's thread, that the operation about to run may block the loop
    for up to ``seconds`` (a kernel's JIT compile): the process's registration, if it took such
    notices, extends its promised next beat so peers do not call the process dead meanwhile."""
    if _long_op_notice is not None:
        _long_op_notice(seconds)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Entry)


_UNHANDLED: list["Registration"] = []
"""Entries written while SIGTERM still had its default action (see :func:`_remove_then_die`)."""


def _remove_then_die(signum: int, frame) -> None:
    """SIGTERM to a process that registered but has not installed its service's handler yet
    (:func:`rlcli.process.stop_on_signals`, which replaces this one): its entries are removed,
    then it dies of the signal as it would have. Without this, a launcher's SIGTERM that came
    between the registration and the handler (a busy host) left the entry of a dead process."""
    for registration in list(_UNHANDLED):
        registration.close()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _guard_until_handled(registration: "Registration") -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # handlers belong to the main thread
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, _remove_then_die):
        signal.signal(signal.SIGTERM, _remove_then_die)
        _UNHANDLED.append(registration)


class Registration:
    """This process's registry entry; the work loop keeps it fresh with :meth:`beat`. Until the
    process installs its own SIGTERM handler, a SIGTERM removes the entry before the process dies
    (:func:`_remove_then_die`)."""

    def __init__(self, registry_dir: str | Path, role: str, instance: str | int, endpoints: dict[str, str],
                 info: dict[str, Any] | None = None, interval: float = HEARTBEAT_INTERVAL_S):
        now = time.time()
        self.path = Path(registry_dir) / f"{role}-{instance}.json"
        self.entry = Entry(role=role, id=str(instance), endpoints=endpoints, pid=os.getpid(),
                           host=socket.gethostname(), incarnation=uuid.uuid4().hex[:12], started=now,
                           heartbeat=now, info=dict(info or {}))
        self._interval = interval
        clean_temporaries(self.path.parent)  # a killed process's half-written entry
        holder = _live_holder(self.path)
        if holder is not None:
            other = "pass another --id, " if role == "infer" else ""
            raise RunDirError(f"{self.entry.key} is already running in {self.path.parent.parent} (pid {holder.pid} on "
                              f"{holder.host}): {other}stop that process, or use another --run-dir")
        _guard_until_handled(self)  # before the entry exists: no moment it is written and unguarded
        self._write()
        try:
            check_settings(self.path.parent, self.entry)
        except ConfigError:
            self.close()
            raise

    def beat(self, busy_s: float = 0.0) -> None:
        """Called by the work loop once per iteration: rewrites the entry when the last beat is
        ``interval`` old. ``busy_s`` > 0 announces an operation that blocks the loop for up to
        that long (written now); the first ordinary beat after it withdraws the promise at once,
        so a process stopped after the operation is not covered by it."""
        now = time.time()
        if busy_s > 0:
            self.entry.busy_until = now + busy_s
        elif self.entry.busy_until:
            self.entry.busy_until = 0.0
        elif now - self.entry.heartbeat < self._interval:
            return
        try:
            self._write()
        except OSError:
            pass  # the run directory may be briefly unavailable (NFS); the next beat retries

    def extend(self, busy_s: float) -> None:
        """Promise the next beat within ``busy_s`` from now, unless the standing promise still has half
        of that left (so a run of announcements writes the entry once per ``busy_s / 2``, not each)."""
        now = time.time()
        if self.entry.busy_until - now < busy_s / 2:
            self.entry.busy_until = now + busy_s
            try:
                self._write()
            except OSError:
                pass

    def take_long_op_notices(self) -> None:
        """Make :func:`expect_long` extend this registration (call from the thread of the work loop, which
        is where the operations that announce themselves run)."""
        global _long_op_notice
        _long_op_notice = self.extend

    def update(self, **info: Any) -> None:
        """Merge ``info`` into the entry and write it now (also a beat)."""
        self.entry.info.update(info)
        self._write()

    def _write(self) -> None:
        self.entry.heartbeat = time.time()
        atomic_write_bytes(self.path, _encoder.encode(self.entry), fsync=False)

    def close(self) -> None:
        global _long_op_notice
        if _long_op_notice == self.extend:
            _long_op_notice = None
        if self in _UNHANDLED:
            _UNHANDLED.remove(self)
        try:
            current = read_entry(self.path)
            if current is not None and current.incarnation == self.entry.incarnation:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass


def _live_holder(path: Path, watch_s: float = 2 * HEARTBEAT_INTERVAL_S + 1) -> "Entry | None":
    """The entry at ``path`` if another process that still runs wrote it. On this host its pid
    says; an entry of another host that is not stale counts if its heartbeat moves within
    ``watch_s`` (one that stops beating, even inside a promised busy time, is taken as dead)."""
    entry = read_entry(path)
    here = socket.gethostname()
    if entry is None or (entry.host == here and entry.pid == os.getpid()):
        return None
    if entry.host == here:
        return entry if _pid_alive(entry.pid) else None
    if not entry.alive():
        return None
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = read_entry(path)
        if now is not None and now.incarnation != entry.incarnation:
            return None  # yet another process took it: it will find that one
        if now is not None and now.heartbeat != entry.heartbeat:
            return now
    return None


def check_settings(registry_dir: str | Path, me: Entry) -> None:
    """Refuse ``me`` if a live peer registered before it holds another value of a setting both
    registered (``info["settings"]``, a dotted key -> value)."""
    mine = me.info.get("settings") or {}
    for peer in list_entries(registry_dir):
        if peer.incarnation == me.incarnation or (peer.started, peer.incarnation) > (me.started, me.incarnation):
            continue
        theirs = peer.info.get("settings") or {}
        for key in sorted(mine.keys() & theirs.keys()):
            if mine[key] != theirs[key]:
                raise ConfigError(f"{key} = {_toml(mine[key])} here but {peer.key} (pid {peer.pid} on {peer.host}) "
                                  f"runs with {key} = {_toml(theirs[key])}: give every process of the run the "
                                  f"same {key}")


def _toml(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value).replace("'", '"')


def read_entry(path: str | Path) -> Entry | None:
    try:
        return _decoder.decode(Path(path).read_bytes())
    except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def describe_gone(entry: Entry, now_entry: Entry | None = None) -> str:
    """One line naming a peer that was dropped: dead or stopped (stale heartbeat), restarted, or deregistered."""
    who = f"{entry.key} (pid {entry.pid} on {entry.host})"
    if now_entry is None:
        return f"{who} deregistered"
    if now_entry.incarnation != entry.incarnation:
        return f"{who} restarted as pid {now_entry.pid}"
    return f"{who} is dead or stopped: no heartbeat for {now_entry.silent_s():.1f}s"


def list_entries(registry_dir: str | Path, role: str | None = None, alive_only: bool = True,
                 stale_after: float | None = None) -> list[Entry]:
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
