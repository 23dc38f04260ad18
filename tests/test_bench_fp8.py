"""The FP8 benches' CPU smoke modes run end to end (their GPU figures are in docs/benchmarks.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.timeout(240)
def test_fp8_host_profile_smoke_reports_both_arms_and_the_pieces():
    out = subprocess.run([sys.executable, str(BENCH / "fp8_host_profile.py"), "--smoke", "--steps", "1", "--top", "3"],
                         capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for arm in ("bf16", "fp8"):
        assert f"{arm}: host " in out.stdout
    assert "rlcli/ops/fp8" in out.stdout  # the FP8 arm's cumulative listing names the FP8 path
    assert "fp8 linear fwd+bwd" in out.stdout and "nan" not in out.stdout.split("host us per call")[1]
