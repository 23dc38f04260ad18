"""Pins: a reader that is not registered yet protects the weights it is loading.

rl-sync deletes weight versions older than the newest ``keep_weights``, sparing the
versions that registered servers serve or load. A *restarting* rl-infer reads
RUN/weights/step_N before it registers, so it first writes a pin,
``RUN/weights/.pins/<owner>.json`` = {version, pid, host, time}, and removes it once
registered (the registry entry protects the version from then on).

The race between a pin and a deletion is closed by ordering: the reader writes its pin,
*then* checks that step_N is still STABLE; the pruner moves step_N aside (to
``.step_N.old-<host>-r<rank>-<pid>-<hex>``, marker and all), *then* looks for pins, and moves
it back if it finds one. Either the reader sees step_N gone (and picks again) or the pruner
sees the pin. A pruner killed while the directory is aside leaves it complete and marked under
a temporary name: :func:`~rlcli.transport.atomic.clean_temporaries` (run by rl-sync and rl-train
when they start) moves it back, and it is pruned again later. A pin whose writer is dead
(same host: pid gone; another host: older than ``PIN_TTL_S``) no longer counts.
"""

import os
import socket
import time
from pathlib import Path

from rlcli.transport.atomic import _pid_alive, atomic_write_json, is_stable, read_json, remove_dir, temp_name

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
    if not is_stable(weights_dir):
        return False
    aside = temp_name(weights_dir, "old")
    try:
        os.replace(weights_dir, aside)
    except FileNotFoundError:
        return False
    if version in pinned_versions(weights_dir.parent.parent):
        try:
            os.replace(aside, weights_dir)
            return False
        except OSError:  # written again meanwhile: the new one stands, the old one goes
            pass
    remove_dir(aside)
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
