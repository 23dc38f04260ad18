"""bench/moe_dispatch.py's CPU smoke mode runs both arms end to end (its GPU figures are in
docs/benchmarks.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("ep", [[], ["--ep"]], ids=["layer", "expert-parallel"])
def test_moe_dispatch_smoke_times_both_arms_and_compares_them(ep):
    out = subprocess.run([sys.executable, str(BENCH / "moe_dispatch.py"), "--smoke", *ep], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("tiny"))
    # The tree against itself: the same numbers to the bit.
    assert row.split()[3].endswith("x") and "0.0e+00, 0.0e+00" in row, row
