"""bench/reward_vs_time.py --parallel: every (seed, arm) runs at once on its own cores (the runs
themselves are the demo, minutes each: replaced here by a probe of what each run would inherit)."""

import json
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
    args = Namespace(recipe=Path("r.toml"), max_async=1, steps=None, async_steps=None, extra=[])
    rvt.run_all_parallel(args, [0], tmp_path)
    assert seen == {(0, 0, "sync"): str(cores[:len(cores) // 2]), (0, 1, "async"): str(cores[len(cores) // 2:2 * (len(cores) // 2)])}
    assert sorted(os.sched_getaffinity(0)) == cores  # the caller's own affinity is untouched


def test_parallel_refuses_fewer_cores_than_a_run_needs(rvt, tmp_path):
    args = Namespace(recipe=Path("r.toml"), max_async=1, steps=None, async_steps=None, extra=[])
    many = list(range(len(os.sched_getaffinity(0)) + 1))  # more seeds than cores
    with pytest.raises(SystemExit, match="--parallel needs 3 cores per run"):
        rvt.run_all_parallel(args, many, tmp_path)


def _write_run(run_dir: Path, step_s: float, rewards: list[float]) -> None:
    (run_dir / "metrics").mkdir(parents=True)
    with open(run_dir / "metrics" / "orchestrate.jsonl", "w") as f:
        for i, r in enumerate(rewards):
            f.write(json.dumps({"time": 100.0 + (i + 1) * step_s, "step_s": step_s, "wait_s": 0.0,
                                "reward_mean": r}) + "\n")
    with open(run_dir / "metrics" / "train.jsonl", "w") as f:
        for _ in rewards:
            f.write(json.dumps({"wait_s": 0.0, "compute_s": step_s / 2, "publish_s": 0.0, "save_s": 0.0}) + "\n")


def test_compare_splits_the_ratio_into_speed_and_learning_per_step(rvt, tmp_path, capsys):
    """Async steps in 0.4x of sync's time; it reaches sync's final reward after 33 of 40 steps (one seed),
    or never (another): the ratio, and the two factors it is made of."""
    sync = [0.1 + 0.02 * i for i in range(40)]  # final 5-step mean: 0.86
    _write_run(tmp_path / "a" / "sync", 1.0, sync)
    _write_run(tmp_path / "a" / "async", 0.4, [0.1 + 0.0255 * i for i in range(40)])
    args = Namespace(recipe=Path("r.toml"), max_async=1, steps=None, async_steps=None, extra=[])
    out = rvt.compare(args, 0, tmp_path / "a", ran=True)
    assert out["step_ratio"] == pytest.approx(0.4)
    assert out["async_steps_to_target"] == 33 and out["ratio"] == pytest.approx(33 * 0.4 / 40)
    assert "after 33 steps, sync's run 40" in capsys.readouterr().out
    _write_run(tmp_path / "b" / "sync", 1.0, sync)
    _write_run(tmp_path / "b" / "async", 0.4, [0.1 + 0.015 * i for i in range(40)])
    out = rvt.compare(args, 1, tmp_path / "b", ran=True)
    assert out["ratio"] is None and out["async_steps_to_target"] is None
    assert f"best {out['async_best']:.3f} against {out['target']:.3f} in 40 steps" in capsys.readouterr().out


def test_the_seeds_table_has_both_factors(rvt, tmp_path, monkeypatch, capsys):
    for seed, slope in ((0, 0.0255), (1, 0.015)):
        _write_run(tmp_path / f"seed{seed}" / "sync", 1.0, [0.1 + 0.02 * i for i in range(40)])
        _write_run(tmp_path / f"seed{seed}" / "async", 0.4, [0.1 + slope * i for i in range(40)])
    monkeypatch.setattr(rvt, "run_mode", lambda *a, **kw: "")  # the runs above stand in for the demo's
    monkeypatch.setattr(sys, "argv", ["reward_vs_time.py", "--seeds", "0,1", "--keep", str(tmp_path)])
    rvt.main()
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in ("seed", "0", "1")}
    assert rows["seed"][-4:] == ["step", "x", "at", "step"]
    assert rows["0"][-2:] == ["0.40", "33"] and rows["1"][-2:] == ["0.40", "-"]


def test_async_steps_run_async_past_sync_on_the_same_schedules(rvt, tmp_path, monkeypatch, capsys):
    """--async-steps: the async arm runs that many steps, sync its own; both end their schedules at
    sync's last step (train.schedule_steps), so past it async holds the schedules' last values."""
    _write_run(tmp_path / "sync", 1.0, [0.1 + 0.02 * i for i in range(40)])
    _write_run(tmp_path / "async", 0.4, [0.1 + 0.015 * i for i in range(60)])
    calls = []
    monkeypatch.setattr(rvt, "run_mode", lambda recipe, seed, k, run_dir, steps, extra=(): calls.append(
        (k, steps, list(extra))) or "")
    monkeypatch.setattr(sys, "argv", ["reward_vs_time.py", "--steps", "40", "--async-steps", "60", "--max-async", "2",
                                      "--keep", str(tmp_path)])
    rvt.main()
    assert calls == [(0, 40, ["--train.schedule_steps", "40"]), (2, 60, ["--train.schedule_steps", "40"])]
    out = capsys.readouterr().out
    assert "async reached sync's final reward" in out and "sync's run 40" in out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_parallel_run_that_raises_stops_the_bench(rvt, monkeypatch, tmp_path):
    def boom(*a, **kw):
        raise RuntimeError("no such recipe")

    monkeypatch.setattr(rvt, "run_mode", boom)
    monkeypatch.setattr(rvt, "MIN_CORES", 1)
    args = Namespace(recipe=Path("r.toml"), max_async=1, steps=None, async_steps=None, extra=[])
    with pytest.raises(SystemExit, match="seed 0, sync: RuntimeError"):
        rvt.run_all_parallel(args, [0], tmp_path)
