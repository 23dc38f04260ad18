"""bench/weight_sync.py runs its processes end to end on the CPU: two FSDP2 trainer ranks in a gloo
group publishing through the collective transport with one and two senders, and through the
filesystem, to one server; every server ends bit-identical to the trainer, and two senders each
stage about half of the transfer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "weight_sync.py"

pytestmark = pytest.mark.timeout(300)


def test_two_trainer_ranks_one_and_two_senders(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--train-nproc", "2", "--senders", "1,2",
                           "--modes", "collective,filesystem", "--servers", "1", "--bucket-mb", "0.05",
                           "--tmp", str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert set(rows) == {"collective s1", "collective s2", "filesystem"}
    assert all(r["bit_identical"] for r in rows.values())
    assert rows["collective s1"]["staged_share"] == 1.0
    assert 0.3 < rows["collective s2"]["staged_share"] < 0.7


def test_more_senders_than_trainer_ranks_is_refused():
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--train-nproc", "2", "--senders", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "raise --train-nproc" in proc.stderr.strip().splitlines()[-1]
