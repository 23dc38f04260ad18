"""bench/async_vs_sync.py's step-time ratio interval (the runs themselves are minutes each)."""

import random
import statistics
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def avs(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as `python bench/async_vs_sync.py` has it
    import async_vs_sync

    return async_vs_sync


def test_ratio_interval_brackets_the_ratio_and_narrows_with_more_steps(avs):
    rng = random.Random(0)
    # Sync steps long-tailed (a batch waits for its longest completion), async ones steadier and ~2x shorter.
    sync = [rng.lognormvariate(0, 0.8) for _ in range(320)]
    asyn = [rng.lognormvariate(0, 0.3) / 2 for _ in range(320)]
    widths = []
    for n in (40, 320):
        lo, hi = avs.ratio_interval(sync[:n], asyn[:n])
        point = statistics.fmean(sync[:n]) / statistics.fmean(asyn[:n])
        assert lo < point < hi
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2  # ~1/sqrt(8) as wide
    assert avs.ratio_interval([1.0] * 10, [0.5] * 10) == (2.0, 2.0)  # no spread, no interval
