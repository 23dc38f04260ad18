"""Pins: a reader that is not registered yet protects the weights it is loading.

rl-sync deletes weight versions older than the newest ``keep_weights``, sparing the
versions that registered servers serve or load. A *restarting* rl-infer reads
RUN/weights/step_N before it registers, so it first writes a pin,
``RUN/weights/.pins/<owner>.json`` = {version, pid, host, time}, and removes it once
registered (the registry entry protects the version from then on).

The race between a pin and a deletion is closed by ordering: the reader writes its pin,
*then* checks that step_N is still STABLE; the pruner removes the STABLE marker, *then*
looks for pins, and puts the marker back if it finds one. Either the reader sees the
marker gone (and picks again) or the pruner sees the pin. A pin whose writer is dead
(same host: pid gone; another host: older than ``PIN_TTL_S``) no longer counts.
"""

import os
import socket
import time
from pathlib import Path

from rlcli.transport.atomic import (
    STABLE, _pid_alive, atomic_write_bytes, atomic_write_json, is_stable, read_json, remove_dir,
)

PIN_TTL_S = 3600.0


def pin_dir(run_root: str | Path) -> Path:
    return Path(run_root) / "weights" / ".pins"


def pin(run_root: str | Path, owner: str, version: int) -> Path:
    path = pin_dir(run_root) / f"{owner}.json"
    atomic_write_json(path, {"version": version, "pid": os.getpid(), "host": socket.gethostname(),
                             "time": time.time()})
    return path


def unpin(path: Path) -> None:
    path.unlink(missing_ok=True)


def pinned_versions(run_root: str | Path) -> set[int]:
    out = set()
    directory = pin_dir(run_root)
    if not directory.is_dir():
        return out
    for path in directory.glob("*.json"):
        try:
            p = read_json(path)
        except ValueError:
            continue
        if not p:
            continue
        alive = _pid_alive(int(p["pid"])) if p.get("host") == socket.gethostname() else \
            time.time() - float(p.get("time", 0)) < PIN_TTL_S
        if alive:
            out.add(int(p["version"]))
    return out


def prune_weights(weights_dir: Path, version: int) -> bool:
    """Delete ``weights_dir`` (policy ``version``) unless a live reader pinned it; True if deleted."""
    try:
        marker = (weights_dir / STABLE).read_bytes()  # as written: a corrupt marker is pruned too
    except FileNotFoundError:
        return False
    (weights_dir / STABLE).unlink(missing_ok=True)
    if version in pinned_versions(weights_dir.parent.parent):
        atomic_write_bytes(weights_dir / STABLE, marker)
        return False
    remove_dir(weights_dir)
    return True


def pin_latest(run_root: str | Path, owner: str, latest) -> tuple[int, Path]:
    """Pin the newest STABLE version (``latest()`` returns it, waiting if needed) and make sure
    it is still there after pinning; (version, pin path)."""
    while True:
        version = latest()
        path = pin(run_root, owner, version)
        if is_stable(Path(run_root) / "weights" / f"step_{version}"):
            return version, path
        unpin(path)
