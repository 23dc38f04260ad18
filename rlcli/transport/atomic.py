"""Atomic files and directories.

A reader must never take a half-written file as complete. Files are written to a
temporary name in the same directory, fsynced, and renamed over the target (rename is
atomic on POSIX filesystems, including NFS and Lustre for same-directory renames).
Directories are built under a temporary name, renamed into place, and only then
marked complete by a ``STABLE`` marker file written last: readers look for the marker,
never for the directory.
"""

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

STABLE = "STABLE"


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
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
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


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_marker(directory: str | Path, payload: dict[str, Any] | None = None) -> None:
    """Mark ``directory`` complete. The marker holds a small JSON payload (time, extra info)."""
    atomic_write_json(Path(directory) / STABLE, {"time": time.time(), **(payload or {})})


def read_marker(directory: str | Path) -> dict[str, Any] | None:
    """The marker payload of a complete directory, or None if it is not (yet) complete."""
    return read_json(Path(directory) / STABLE)


def is_stable(directory: str | Path) -> bool:
    return (Path(directory) / STABLE).is_file()


@contextlib.contextmanager
def atomic_dir(final: str | Path, marker: dict[str, Any] | None = None) -> Iterator[Path]:
    """Build a directory under a temporary name; on success rename it to ``final`` and mark it.

    An existing ``final`` (complete or not) is replaced: the old one is first moved aside
    and deleted after the new one is in place, so readers see either the old complete
    directory or the new one. On error the temporary directory is removed.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for child in tmp.iterdir():
            if child.is_file():
                with open(child, "rb") as f:
                    os.fsync(f.fileno())
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            (final / STABLE).unlink(missing_ok=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        write_marker(final, marker)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_dir(directory: str | Path) -> None:
    """Unmark, then delete: a reader never sees a marked directory being deleted."""
    directory = Path(directory)
    (directory / STABLE).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_temporaries(parent: str | Path) -> None:
    """Remove temporaries left in ``parent`` by writers that are no longer running."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for child in parent.iterdir():
        name = child.name
        if name.startswith(".") and (".tmp-" in name or ".old-" in name):
            pid = name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
                continue
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
