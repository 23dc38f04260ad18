"""bench/engine_queues.py's smoke mode runs both arms end to end (its figure is in docs/benchmarks.md)."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_engine_queues_smoke_runs_both_arms_and_prints_the_ratio():
    out = subprocess.run([sys.executable, str(BENCH / "engine_queues.py"), "--smoke"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "baseline " in out.stdout and "tree " in out.stdout and "4 prompts x 4 x 12 tokens" in out.stdout
    assert out.stdout.rstrip().endswith("x")
