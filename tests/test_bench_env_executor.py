"""bench/env_executor.py runs (its --smoke mode) and prints both executors and their ratio."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_env_executor_bench_smoke():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "env_executor.py"), "--smoke"], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "ratio threads/processes" in out.stdout
    result = json.loads(out.stdout.splitlines()[-1])
    assert {result["threads"]["executor"], result["processes"]["executor"]} == {"threads", "processes"}
