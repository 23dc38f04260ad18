"""bench/reward_vs_time.py --parallel: every (seed, arm) runs at once on its own cores (the runs
themselves are the demo, minutes each: replaced here by a probe of what each run would inherit)."""

import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def rvt(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as `python bench/reward_vs_time.py` has it
    import reward_vs_time

    return reward_vs_time


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_parallel_runs_get_disjoint_cores_that_their_processes_inherit(rvt, monkeypatch, tmp_path):
    seen = {}

    def probe(recipe, seed, max_async, run_dir, steps, extra=()):  # what `rl-orchestrate up` would inherit
        out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                             capture_output=True, text=True, check=True).stdout
        seen[(seed, max_async, run_dir.relative_to(tmp_path).as_posix())] = out.strip()
        return ""

    monkeypatch.setattr(rvt, "run_mode", probe)
    monkeypatch.setattr(rvt, "MIN_CORES", 1)
    cores = sorted(os.sched_getaffinity(0))
    args = Namespace(recipe=Path("r.toml"), max_async=1, steps=None, extra=[])
    rvt.run_all_parallel(args, [0], tmp_path)
    assert seen == {(0, 0, "sync"): str(cores[:len(cores) // 2]), (0, 1, "async"): str(cores[len(cores) // 2:2 * (len(cores) // 2)])}
    assert sorted(os.sched_getaffinity(0)) == cores  # the caller's own affinity is untouched


def test_parallel_refuses_fewer_cores_than_a_run_needs(rvt, tmp_path):
    args = Namespace(recipe=Path("r.toml"), max_async=1, steps=None, extra=[])
    many = list(range(len(os.sched_getaffinity(0)) + 1))  # more seeds than cores
    with pytest.raises(SystemExit, match="--parallel needs 3 cores per run"):
        rvt.run_all_parallel(args, many, tmp_path)
