"""Atomic files and directories.

A reader must never take a half-written file as complete. Files are written to a
temporary name in the same directory, fsynced, and renamed over the target (rename is
atomic on POSIX filesystems, including NFS and Lustre for same-directory renames).
Directories are built under a temporary name, renamed into place, and only then
marked complete by a ``STABLE`` marker file written last: readers look for the marker,
never for the directory.

Temporary names carry host, rank, pid and a random tag
(``.name.tmp-<host>-r<rank>-<pid>-<hex>``): several ranks and hosts write into one shared
run directory, and :func:`clean_temporaries` removes what a dead process of this host left
(its pid is gone). Whether a process on another host is alive cannot be asked, so another
host's temporary counts as abandoned once nothing in it has changed for
:data:`STALE_TEMP_S` (a writer's files change as it writes), and another host's
``.name.old-*`` standing in for a missing ``name`` once it has been there for
:data:`REPLACE_GRACE_S` (its writer dies between two renames, or is past them in
microseconds): after a Slurm requeue onto other nodes, a dead node's leftovers go too. A directory
written by several ranks is built with :func:`begin_dir` / :func:`commit_dir`: one rank
creates and later renames and marks it, after a barrier
(``rlcli.parallel.dist.shared_atomic_dir``).

Every committed directory's STABLE marker carries a manifest: the size and the checksum
(:mod:`rlcli.transport.checksum`) of each file, taken from the files just written, and
the marker carries the checksum of its own JSON. :func:`verify_dir` checks the marker, one
``stat`` per file and the checksum of the small files (<= 1 MiB: configs, indexes,
checkpoint metadata), so a truncated file or a corrupt index or marker is caught before
use. A large file's checksum (:func:`checksums_of`) is checked by its reader on the bytes
it parses, without a second pass over the file.

A write that fails for lack of space (ENOSPC, EDQUOT, EFBIG, EROFS; also as the
message of a library's own error, e.g. safetensors) removes its temporary and raises
:class:`rlcli.errors.StorageFull` naming the target: the previous STABLE state is
untouched, and the command stops with one line.

Replacing a complete directory never leaves a moment without one: the new directory is
marked STABLE while still under its temporary name, then swapped with the old one in
one ``renameat2(RENAME_EXCHANGE)`` (Linux; ext4, xfs, btrfs, tmpfs). Where the
filesystem refuses the exchange (NFS, Lustre) it falls back to two renames, and a crash
between them leaves ``.name.old-*`` complete and marked, which :func:`clean_temporaries`
moves back into place instead of deleting.
"""

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from rlcli.errors import StorageFull
from rlcli.transport.checksum import ALGO, checksum, file_checksum

STABLE = "STABLE"

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "File too large", "Read-only file system")


_FULL_MARGIN = 64 << 20
"""Bytes still free on a filesystem under which a failed write counts as a full disk."""


def storage_full(exc: BaseException, target: str | Path, written: str | Path | None = None) -> StorageFull | None:
    """The user-facing error for ``exc`` if it is a full (or read-only) disk, else None.

    The reason is looked for in ``exc``, in the exceptions it wraps (``__cause__``,
    ``__context__``, DCP's per-rank ``CheckpointException.failures``), and, when none names
    it, on the filesystem of ``written`` (what the failed write was writing, checked before
    it is removed): fewer than 64 MiB free there is a full disk. Some writers report a short
    write only by its effect, as torch's zip writer does under DCP ("unexpected pos 704 vs
    598"), which a full disk behind a checkpoint of the whole trainer state raised on a GPU
    machine."""
    reason = None
    seen, todo = set(), [exc]
    while todo and reason is None:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            reason = e.strerror
        else:
            reason = next((t for t in _FULL_TEXT if t in str(e)), None)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    if reason is None and written is not None:
        try:
            st = os.statvfs(written)
        except OSError:
            st = None
        if st is not None and st.f_bavail * st.f_frsize < _FULL_MARGIN:
            reason = f"No space left on device ({st.f_bavail * st.f_frsize >> 20} MiB free after: {exc})"
    if reason is None:
        return None
    return StorageFull(f"cannot write {target}: {reason}; free space on that filesystem (or pass another "
                       "--run-dir) and restart: the last STABLE state is intact")


_HOST = socket.gethostname().replace("/", "_")
_TEMP_RE = re.compile(r"\.(?:tmp|old)-(?P<host>.+)-r(?P<rank>\d+)-(?P<pid>\d+)(?:-[0-9a-f]{8})?$")


def temp_tag() -> str:
    """``<host>-r<rank>-<pid>``: who owns a temporary name (rank from torchrun's RANK)."""
    return f"{_HOST}-r{os.environ.get('RANK', '0')}-{os.getpid()}"


def temp_name(path: Path, kind: str = "tmp") -> Path:
    """``path``'s sibling ``.name.<kind>-<host>-r<rank>-<pid>-<hex>``, a name of this process's that
    :func:`clean_temporaries` judges (``kind`` "old": a complete directory moved aside, put back if
    its name is still free when its owner is gone)."""
    return path.with_name(f".{path.name}.{kind}-{temp_tag()}-{uuid.uuid4().hex[:8]}")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, *, fsync: bool = True) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per call: two threads of one process may write the same file at once.
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)  # a target that cannot be replaced (a directory) leaves no temporary either
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise (storage_full(e, path) or e) from None
    if fsync:
        _fsync_dir(path.parent)


def atomic_write_json(path: str | Path, obj: Any, *, fsync: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), fsync=fsync)


def read_json(path: str | Path, default: Any = None) -> Any:
    """Read a JSON file written by :func:`atomic_write_json`; ``default`` when absent."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default


def why_unreadable(e: OSError | ValueError) -> str:
    """A few words on why :func:`read_json` raised ``e``: the OS's reason, the JSON error, or bytes
    that are not UTF-8."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return f"not JSON: {e.msg}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"


def write_checked_json(path: str | Path, payload: dict[str, Any], *, fsync: bool = True) -> None:
    """A small JSON state file (progress) with the checksum of its own content, as a marker."""
    payload = {k: v for k, v in payload.items() if k != "checksum"}
    atomic_write_json(path, {**payload, "checksum": _marker_sum(payload)}, fsync=fsync)


def read_checked_json(path: str | Path) -> dict[str, Any] | None:
    """What :func:`write_checked_json` wrote; None when the file is absent, unparsable or its
    checksum does not match (a file without one, from before checksums, is taken as is)."""
    payload, _ = _load_checked(Path(path))
    return None if payload is None else {k: v for k, v in payload.items() if k != "checksum"}


def _load_checked(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """One read of a checksummed JSON file: (payload, None) if intact or written before
    checksums, (None, why) if corrupt, (None, None) if absent."""
    try:
        payload = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, None
    except ValueError:
        return None, f"{path} is corrupt: not valid JSON"
    if not isinstance(payload, dict):
        return None, f"{path} is corrupt: not a JSON object"
    if "checksum" in payload and payload["checksum"] != _marker_sum(payload):
        return None, f"{path} is corrupt: its {ALGO} is {_marker_sum(payload)}, {payload['checksum']} was written"
    return payload, None


def _marker_sum(payload: dict[str, Any]) -> str:
    return checksum(json.dumps({k: v for k, v in payload.items() if k != "checksum"}, sort_keys=True).encode())


def write_marker(directory: str | Path, payload: dict[str, Any] | None = None) -> None:
    """Mark ``directory`` complete. The marker holds a small JSON payload (time, extra info,
    the manifest) and the checksum of that payload."""
    write_checked_json(Path(directory) / STABLE, {"time": time.time(), **(payload or {})})


def marker_problem(directory: str | Path) -> str | None:
    """Why the STABLE marker of ``directory`` cannot be trusted (unparsable, or its checksum does
    not match), or None (intact, absent, or written before markers carried a checksum)."""
    return _load_checked(Path(directory) / STABLE)[1]


def read_marker(directory: str | Path) -> dict[str, Any] | None:
    """The marker payload of a complete directory, or None if it is not (yet) complete or
    its marker is corrupt (:func:`marker_problem` says why)."""
    return _load_checked(Path(directory) / STABLE)[0]


def is_stable(directory: str | Path) -> bool:
    return (Path(directory) / STABLE).is_file()


def begin_dir(final: str | Path) -> Path:
    """Create (empty) the temporary directory that :func:`commit_dir` will move to ``final``."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    tmp.mkdir()
    return tmp


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the OS or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


SMALL_FILE_BYTES = 1 << 20


def manifest(directory: Path, known: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """{"sizes": {file: bytes}, "xxh3_64": {file: hex}} of every file under ``directory``;
    ``known`` holds checksums a writer took already (e.g. each trainer rank of its own shards)."""
    sizes, sums = {}, {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != STABLE):
        rel = str(path.relative_to(directory))
        sizes[rel] = path.stat().st_size
        sums[rel] = (known or {}).get(rel) or file_checksum(path)
    return {"sizes": sizes, ALGO: sums}


def checksums_of(directory: str | Path) -> dict[str, str]:
    """{file relative to ``directory``: checksum} from its STABLE manifest (empty without one)."""
    return dict(((read_marker(directory) or {}).get("manifest") or {}).get(ALGO) or {})


def verify_dir(directory: str | Path) -> list[str]:
    """Problems of a STABLE directory: a corrupt marker, a missing or resized file, a small file
    whose checksum does not match (empty: intact, or no manifest). Large files are checked by their
    readers on the bytes they parse."""
    directory = Path(directory)
    bad_marker = marker_problem(directory)
    if bad_marker is not None:
        return [bad_marker]
    m = (read_marker(directory) or {}).get("manifest")
    if not m:
        return []
    problems = []
    for rel, size in m["sizes"].items():
        try:
            actual = (directory / rel).stat().st_size
        except FileNotFoundError:
            problems.append(f"{rel} is missing")
            continue
        if actual != size:
            problems.append(f"{rel} has {actual} bytes, {size} were written")
    for rel, digest in (m.get(ALGO) or {}).items():
        if m["sizes"].get(rel, SMALL_FILE_BYTES + 1) <= SMALL_FILE_BYTES and \
                not any(p.startswith(rel) for p in problems) and checksum((directory / rel).read_bytes()) != digest:
            problems.append(f"{rel} does not match its {ALGO}")
    for rel, digest in (m.get("sha256") or {}).items():  # manifests written before checksums
        if rel in m["sizes"] and not any(p.startswith(rel) for p in problems) and \
                hashlib.sha256((directory / rel).read_bytes()).hexdigest() != digest:
            problems.append(f"{rel} does not match its sha256")
    return problems


def verify_files(directory: str | Path) -> list[str]:
    """:func:`verify_dir` plus the checksum of every large file: a full pass, for readers that cannot
    hash the bytes they parse (the trainer reads only its slices of policy 0)."""
    directory = Path(directory)
    problems = verify_dir(directory)
    if problems:
        return problems
    m = (read_marker(directory) or {}).get("manifest") or {}
    for rel, digest in (m.get(ALGO) or {}).items():
        if m["sizes"].get(rel, 0) > SMALL_FILE_BYTES and file_checksum(directory / rel) != digest:
            problems.append(f"{rel} does not match its {ALGO}")
    return problems


def commit_dir(tmp: Path, final: str | Path, marker: dict[str, Any] | None = None,
               checksums: dict[str, str] | None = None) -> None:
    """fsync ``tmp``'s files, move it to ``final`` (replacing an old one) and mark it STABLE
    with a manifest of what was written (``checksums``: checksums already taken by the writers)."""
    final = Path(final)
    for child in tmp.iterdir():
        if child.is_file():
            with open(child, "rb") as f:
                os.fsync(f.fileno())
    marker = {**(marker or {}), "manifest": manifest(tmp, checksums)}
    if not final.exists():
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        write_marker(final, marker)
        return
    write_marker(tmp, marker)  # complete before it is visible: no unmarked moment
    if _exchange(tmp, final):  # tmp now holds the old directory
        _fsync_dir(final.parent)
        remove_dir(tmp)
        return
    old = temp_name(final, "old")
    os.replace(final, old)  # a crash here: clean_temporaries moves old back
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    remove_dir(old)


@contextlib.contextmanager
def atomic_dir(final: str | Path, marker: dict[str, Any] | None = None,
               checksums: dict[str, str] | None = None) -> Iterator[Path]:
    """Build a directory under a temporary name; on success rename it to ``final`` and mark it.

    An existing ``final`` (complete or not) is replaced by an atomic exchange (see the
    module note), so readers see either the old complete directory or the new one. On
    error the temporary directory is removed. ``checksums`` may be filled inside the block
    with the checksums of files written from memory (no read-back for the manifest). A ``final``
    that is a file is refused before anything is written (the exchange would move the file aside).
    """
    if Path(final).exists() and not Path(final).is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "a directory cannot replace this file", str(final))
    tmp = begin_dir(final)
    try:
        yield tmp
        commit_dir(tmp, final, marker, checksums)
    except BaseException as e:
        full = storage_full(e, final, written=tmp)  # before the temporary's space is freed
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from None
        raise


def remove_dir(directory: str | Path) -> None:
    """Move ``directory`` to a temporary name of this process's, then delete it there. Its name and
    marker go in one rename, so a reader never sees a marked directory being deleted; and a deleter
    killed midway (a checkpoint of a large model takes a while) leaves a temporary that
    :func:`clean_temporaries` removes, not a half-deleted, unmarked ``step_N`` that nothing would. A
    directory already under a temporary name is deleted where it is."""
    directory = Path(directory)
    doomed = directory
    if not (directory.name.startswith(".") and _TEMP_RE.search(directory.name)):
        doomed = temp_name(directory)
        try:
            os.replace(directory, doomed)
        except FileNotFoundError:
            return
        except OSError:  # a filesystem that refuses the rename: unmark, then delete in place
            doomed = directory
    (doomed / STABLE).unlink(missing_ok=True)
    shutil.rmtree(doomed, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, dead but not yet waited for, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


STALE_TEMP_S = 3600.0
"""Another host's temporary in which nothing changed for this long is abandoned (module note)."""
REPLACE_GRACE_S = 60.0
"""Another host's complete ``.name.old-*`` with ``name`` missing this long: the replace died midway."""


def _last_change(path: Path) -> float:
    """The latest modification or status change of ``path`` or anything under it (0: gone)."""
    latest = 0.0
    for p in [path, *(path.rglob("*") if path.is_dir() else ())]:
        try:
            st = p.lstat()
        except OSError:
            continue
        latest = max(latest, st.st_mtime, st.st_ctime)
    return latest


def _owner_alive(path: Path, mid_replace: bool = False) -> bool:
    name = path.name
    m = _TEMP_RE.search(name)
    if m is None:  # an older name, ``.x.tmp-<pid>``: judged on this host
        pid = name.rsplit("-", 1)[-1]
        return pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid))
    if m["host"] != _HOST:  # another host's writer: judged by how long its files stood still
        return time.time() - _last_change(path) < (REPLACE_GRACE_S if mid_replace else STALE_TEMP_S)
    return int(m["pid"]) != os.getpid() and _pid_alive(int(m["pid"]))


def clean_temporaries(parent: str | Path) -> None:
    """Remove temporaries left in ``parent`` by writers that are no longer running (this host's:
    their pid is gone; another host's: unchanged for :data:`STALE_TEMP_S`); a complete
    ``.name.old-*`` whose ``name`` is missing (a crash mid-replace) is moved back."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for child in parent.iterdir():
        name = child.name
        if name.startswith(".") and (".tmp-" in name or ".old-" in name):
            final = parent / name[1:name.index(".old-")] if ".old-" in name else None
            restore = final is not None and child.is_dir() and is_stable(child) and not final.exists()
            if _owner_alive(child, mid_replace=restore):
                continue
            if restore:
                os.replace(child, final)
                continue
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
