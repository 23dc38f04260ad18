"""EP, CP and EP x CP under torchrun with real gloo process groups, against a single-process
reference computed in the same run (see dist_ep_cp.py): loss and every gradient match."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("dist_ep_cp.py")


@pytest.mark.parametrize("nproc", [2, 4])
def test_ep_cp_match_single_process(nproc):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240)
    report = [line for line in proc.stdout.splitlines() if line.startswith("[rank")]
    print("\n".join(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len([line for line in report if " ok " in line]) >= 4
