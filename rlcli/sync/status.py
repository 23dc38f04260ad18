"""RUN/sync/status.json: what ``rl-sync status`` shows.

rl-sync rewrites it whenever something in it changes: each server's served version, state
(admitted, skipped, loading) and consecutive failed loads, and the last update's timing broken
down into the trainer's gather (collecting the tensors; DTensors are all-gathered), its send (collective
broadcast) or write (files durable), the slowest server's load, and the total from
rl-sync learning of the version to ``PolicyUpdated``.
"""

import json
from pathlib import Path
from typing import Any

from rlcli.transport.atomic import atomic_write_bytes, read_json

STATUS_FILE = Path("sync") / "status.json"
_last: dict[str, str] = {}
"""Path -> the JSON text last written there. Text, not the dict: rl-sync completes ``last_update``
in place (the trainer's report of a send can follow the announcement), and a cached dict sharing
it would change with it and compare equal."""


def write_status(run, kind: str, policy_version: int, target: int, servers: dict, last_update: dict) -> None:
    status = {
        "backend": kind, "policy_version": policy_version, "latest_published": target,
        "servers": {key: {"version": s.version, "host": s.entry.host, "pid": s.entry.pid,
                          "state": "skipped" if s.skipped else "loading" if s.pending else "admitted",
                          "last_error": s.last_error, "failed_loads": s.failures}
                    for key, s in sorted(servers.items())},
        "last_update": last_update,
    }
    path = Path(run.root) / STATUS_FILE
    text = json.dumps(status, indent=1, sort_keys=True) + "\n"
    if _last.get(str(path)) != text:
        atomic_write_bytes(path, text.encode(), fsync=False)
        _last[str(path)] = text


def read_status(run_root: str | Path) -> dict[str, Any] | None:
    try:
        return read_json(Path(run_root) / STATUS_FILE)
    except (OSError, json.JSONDecodeError):
        return None


def render(status: dict[str, Any]) -> str:
    """A short human-readable table of a status dict."""
    lines = [f"backend {status['backend']}: policy v{status['policy_version']} live, "
             f"v{status['latest_published']} published"]
    for key, s in status["servers"].items():
        err = f"  ({s['last_error']})" if s.get("last_error") else ""
        if s.get("failed_loads"):
            err = f"  ({s['failed_loads']} failed loads in a row: {s['last_error']})"
        lines.append(f"  {key:<12} v{s['version']:<6} {s['state']:<9} {s['host']} pid {s['pid']}{err}")
    u = status.get("last_update") or {}
    if u:
        parts = [f"{k.removesuffix('_s')} {u[k]:.3f}s" for k in ("gather_s", "group_s", "send_s", "write_s", "load_s", "total_s")
                 if u.get(k) is not None]
        lines.append(f"last update v{u['version']}: " + ", ".join(parts))
    return "\n".join(lines)
