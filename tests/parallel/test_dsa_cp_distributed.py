"""DSA under context parallelism with real gloo process groups (see dist_dsa_cp.py): queries
local, latent KV + indexer keys gathered once per layer, top-k over the whole row; loss and
every gradient match one process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("dist_dsa_cp.py")


@pytest.mark.parametrize("nproc", [2, 4])
def test_dsa_cp_matches_single_process(nproc):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240)
    report = [line for line in proc.stdout.splitlines() if line.startswith("[rank")]
    print("\n".join(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len([line for line in report if " ok " in line]) == 2
