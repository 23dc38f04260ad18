"""Metrics of long-running servers over fixed wall-clock intervals.

rl-train and rl-orchestrate append a record per step. rl-infer and rl-cache have no steps, so they
append one every ``every_s`` seconds to ``RUN/metrics/<command>.jsonl`` in which anything
happened: each counter's change over the interval, and what the caller derives from the changes
(rates, hit rates), beside gauges read at its end. Its ``step`` is the interval's number since
the process started (so the metric sinks' step axis runs with time).
"""

import time
from typing import Mapping


class IntervalCounters:
    """Changes of monotonic counters since the last :meth:`take`, which is due every ``every_s``."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.started = time.monotonic()
        self.last: dict[str, float] = {}
        self.index = 0  # of the interval the last take ended

    def due(self) -> bool:
        return self.every_s > 0 and time.monotonic() - self.started >= self.every_s

    def take(self, counters: Mapping[str, float]) -> tuple[dict[str, float], float]:
        """(each counter's change since the last take, seconds since then); starts a new interval."""
        now = time.monotonic()
        changes = {k: float(v) - self.last.get(k, 0.0) for k, v in counters.items()}
        elapsed, self.started = now - self.started, now
        self.last = {k: float(v) for k, v in counters.items()}
        self.index += max(1, round(elapsed / self.every_s)) if self.every_s > 0 else 1
        return changes, elapsed


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None
