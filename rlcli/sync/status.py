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

from rlcli.errors import RunDirError
from rlcli.transport.atomic import atomic_write_bytes, read_json, why_unreadable

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
    """The status rl-sync last wrote; None when there is none yet. A file that is there but cannot
    be read, or is not what rl-sync writes (a truncated copy, another program's), is a RunDirError
    naming it: rl-sync replaces it whole at its next change."""
    path = Path(run_root) / STATUS_FILE
    try:
        status = read_json(path)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise RunDirError(f"{path} is unreadable or damaged ({why_unreadable(e)}); rl-sync rewrites it at its next update "
                          "(or delete it)") from None
    if status is None:
        return None
    problem = _problem(status)
    if problem:
        raise RunDirError(f"{path} is damaged ({problem}); rl-sync rewrites it at its next update (or delete it)")
    return status


_SERVER_KEYS = ("version", "state", "host", "pid")


def _problem(status: Any) -> str:
    """What makes ``status`` other than what :func:`write_status` writes ('' if nothing)."""
    if not isinstance(status, dict):
        return f"a JSON {type(status).__name__}, not an object"
    missing = [k for k in ("backend", "policy_version", "latest_published", "servers") if k not in status]
    if missing:
        return f"no {', '.join(missing)}"
    if not isinstance(status["servers"], dict) or not all(
            isinstance(s, dict) and all(k in s for k in _SERVER_KEYS) for s in status["servers"].values()):
        return f"servers is not a table of {', '.join(_SERVER_KEYS)}"
    update = status.get("last_update") or {}
    if not isinstance(update, dict) or (update and "version" not in update) or not all(
            v is None or isinstance(v, (int, float)) for k, v in update.items() if k.endswith("_s")):
        return "last_update is not a table of a version and its timings"
    return ""


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
