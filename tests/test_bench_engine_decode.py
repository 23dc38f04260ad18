"""bench/engine_decode.py's smoke mode runs both arms end to end and prints a ratio per concurrency."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


# --paged-decode, --cuda-graphs: the tree's arm with infer.engine.paged_decode or cuda_graphs (on the CPU both
# keep the eager path); --host-only: both arms with fixed logits; --fp8: FP8 weights (the emulated GEMMs here).
@pytest.mark.parametrize("extra", [[], ["--paged-decode"], ["--cuda-graphs"], ["--host-only"], ["--fp8", "tree"]])
def test_engine_decode_smoke_runs_both_arms_at_each_concurrency(extra):
    out = subprocess.run([sys.executable, str(BENCH / "engine_decode.py"), "--smoke", *extra], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "8"] and all(r[3].endswith("x") for r in rows)
