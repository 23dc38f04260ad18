"""How the trainer, rl-sync and the servers meet for a collective weight update.

rl-sync hosts one TCPStore for its lifetime and writes its address to
RUN/sync/store.json (atomically, with an id per start): the run directory is the
rendezvous, as for every other peer. The store carries the weight-transfer groups (one
``PrefixStore`` per generation, see :mod:`rlcli.transport.collective`) and a small control
protocol between the trainer's sending rank and rl-sync, all JSON values:

- ``ctl/published``: the newest version the trainer holds staged, its tensor list,
  ``bucket_bytes`` and how many of its ranks send (the trainer rewrites it on every publish
  and after rl-sync restarts);
- ``ctl/round/<r>``: rl-sync orders round ``r`` (group, world size, ``min_version``: the
  oldest version its members want); ``ctl/rounds`` counts the rounds ordered so far. An
  order stays open until the trainer takes it, so rl-sync places the next one as soon as
  a round ends and the trainer takes it the moment it stages a new version: the order
  hop is off the update's path;
- ``ctl/accept/<r>``: written once, by compare-and-set: the trainer takes the round for the
  version it holds (``{"version": v}``, v >= min_version), or rl-sync withdraws it
  (``"withdrawn"``: its membership changed first). Servers are told to receive only once
  the trainer took it. With several senders, the first takes rounds and the others follow
  these keys: each sends its share of every round taken for the version it holds;
- ``ctl/sent/<r>``: the trainer's outcome (ok or the error) and its send time;
  ``ctl/sent/<r>/s<k>``: sender k's (k >= 1), read into rl-sync's report of a failed round;
- ``ctl/stopped/<token>``: the first round a closing first sender did not take (``token``
  names the trainer's run of the publisher): the other senders serve the rounds before it
  and stop.
"""

import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from rlcli.transport.atomic import atomic_write_json, read_json

STORE_FILE = Path("sync") / "store.json"


def write_store_file(run_root: str | Path, addr: str) -> str:
    """Record rl-sync's store address; returns the id of this start."""
    start_id = uuid.uuid4().hex[:12]
    atomic_write_json(Path(run_root) / STORE_FILE, {"addr": addr, "id": start_id})
    return start_id


def read_store_file(run_root: str | Path) -> dict[str, str] | None:
    try:
        return read_json(Path(run_root) / STORE_FILE)
    except (OSError, json.JSONDecodeError):
        return None


class Control:
    """The control keys of one store (see the module docstring)."""

    def __init__(self, store: dist.Store):
        self.store = store

    def _set(self, key: str, value: Any) -> None:
        self.store.set(f"ctl/{key}", json.dumps(value))

    def _get(self, key: str) -> Any | None:
        """The value of ``key``, or None if it is not set (never blocks)."""
        if not self.store.check([f"ctl/{key}"]):
            return None
        return json.loads(self.store.get(f"ctl/{key}"))

    def wait(self, key: str, timeout_s: float, poll_s: float = 0.002,
             stop: Callable[[], bool] = lambda: False,
             sleep: Callable[[float], None] = time.sleep) -> Any | None:
        """The value of ``key`` once set, or None after ``timeout_s`` or as soon as ``stop()``
        is true. Polls every ``poll_s`` (``sleep`` may return early: an event the caller
        sets): the store's own blocking wait logs a warning at every timeout."""
        deadline = time.monotonic() + timeout_s
        while (value := self._get(key)) is None and time.monotonic() < deadline and not stop():
            sleep(poll_s)
        return value

    # trainer side
    def post_published(self, version: int, tensors: list[list], bucket_bytes: int, timing: dict[str, float],
                       senders: int = 1) -> None:
        self._set("published", {"version": version, "tensors": tensors, "bucket_bytes": bucket_bytes,
                                "timing": timing, "senders": senders})

    def open_round(self) -> int:
        """The round a (re)started sender serves next: the last ordered one while nobody has
        answered it, else the next."""
        n = int(self._get("rounds") or 0)
        return n - 1 if n and self._get(f"accept/{n - 1}") is None else n

    def claim(self, r: int, version: int) -> bool:
        """Take round ``r`` for ``version``; False if rl-sync withdrew it first."""
        return self._decide(r, {"version": version})

    def withdrawn(self, r: int) -> bool:
        return self._get(f"accept/{r}") == "withdrawn"

    def sent(self, r: int, error: str, timing: dict[str, float], sender: int = 0) -> None:
        self._set(f"sent/{r}" + (f"/s{sender}" if sender else ""), {"error": error, "timing": timing})

    def stop_senders(self, token: str, r: int) -> None:
        """The first sender (of the trainer run ``token``) is closing: it took no round from ``r`` on."""
        self._set(f"stopped/{token}", r)

    def senders_stopped(self, token: str) -> int | None:
        """The first round the closing first sender of run ``token`` did not take; None while it runs."""
        return self._get(f"stopped/{token}")

    def round_of(self, r: int) -> dict[str, Any] | None:
        """Round ``r``'s order, or None if it is not ordered yet."""
        return self._get(f"round/{r}")

    def rounds(self) -> int:
        """How many rounds rl-sync has ordered."""
        return int(self._get("rounds") or 0)

    # rl-sync side
    def published(self) -> dict[str, Any] | None:
        return self._get("published")

    def order(self, r: int, min_version: int, group: str, world_size: int) -> None:
        self._set(f"round/{r}", {"min_version": min_version, "group": group, "world_size": world_size})
        self._set("rounds", r + 1)

    def withdraw(self, r: int) -> bool:
        """Withdraw the open round ``r``; False if the trainer took it first."""
        return self._decide(r, "withdrawn")

    def accepted(self, r: int) -> dict | str | None:
        """``{"version": v}`` once the trainer took round ``r``, ``"withdrawn"``, or None."""
        return self._get(f"accept/{r}")

    def outcome(self, r: int, sender: int = 0) -> dict[str, Any] | None:
        return self._get(f"sent/{r}" + (f"/s{sender}" if sender else ""))

    def _decide(self, r: int, value: Any) -> bool:
        want = json.dumps(value)
        return self.store.compare_set(f"ctl/accept/{r}", "", want).decode() == want
