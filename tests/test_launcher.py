"""`rl-orchestrate up`: a failed child stops the run, naming it; Ctrl-C stops every child."""

import json
import os
import signal
import subprocess
import sys

import pytest

from procs import read_jsonl, wait_until, write_recipe
from rlcli.transport.registry import list_entries

pytestmark = pytest.mark.timeout(240)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def all_registered(run_dir):
    """The registry entries once all five processes of the run have registered."""
    return wait_until(lambda: len(list_entries(run_dir / "registry")) >= 5 and list_entries(run_dir / "registry"),
                      120, "all five processes registered")


def start_up(recipe, *args):
    return subprocess.Popen([sys.executable, "-m", "rlcli.cli.orchestrate", "up", str(recipe), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


TRAIN_METRICS = {"loss", "entropy", "mismatch_kl", "mismatch_kl_kept", "masked_low_fraction", "masked_high_fraction",
                 "masked_by_sequence_fraction", "logprob_diff_abs_mean", "logprob_diff_abs_max", "tokens_unique",
                 "tokens_total", "compute_us_per_unique_token"}
ORCHESTRATE_METRICS = {"reward_mean", "completion_len_mean", "generated_len_mean", "dropped_fraction",
                       "straggler_wait_s", "num_redispatched", "off_policy_lag_max"}


def test_up_runs_to_the_end_with_summary_and_plot(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 4})
    proc = start_up(recipe)
    out, err = proc.communicate(timeout=200)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["reward_first5"] is not None
    png = (run_dir / "reward.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    train, orchestrate = (read_jsonl(run_dir / "metrics" / f"{name}.jsonl") for name in ("train", "orchestrate"))
    assert len(train) == 4 and len(orchestrate) == 4
    # the per-step names README and docs/asynchrony.md promise (dashboards and jq scripts read them)
    assert all(TRAIN_METRICS <= set(m) for m in train), TRAIN_METRICS - set(train[-1])
    assert all(ORCHESTRATE_METRICS <= set(m) for m in orchestrate), ORCHESTRATE_METRICS - set(orchestrate[-1])
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "cache-0.log", "infer-0.log", "orchestrate-0.log", "sync-0.log", "train-0.log"]
    # Each child sees its stderr is its log file and adds no second handler writing there.
    for log in (run_dir / "logs").iterdir():
        lines = [line for line in log.read_text().splitlines() if " INFO " in line]
        assert lines and not [a for a, b in zip(lines, lines[1:]) if a == b], log.name
    assert list_entries(run_dir / "registry", alive_only=False) == []  # everyone deregistered
    # threads = "adaptive" (the default) shared the host's cores through RUN/cores/<host>/; each left
    assert [p for p in (run_dir / "cores").iterdir() if p.is_dir()]
    assert not [p for p in (run_dir / "cores").rglob("*") if p.is_file()]


def test_up_serves_a_teacher_for_on_policy_distillation(tmp_path, tiny_model_dir):
    """up.teacher: a model directory served by an rl-infer of its own in RUN/teacher (its own registry, so
    rl-sync never updates it), the orchestrator pointed at it; it stops with the run."""
    from rlcli.models import load_model, save_model

    teacher = tmp_path / "teacher-model"
    save_model(load_model(tiny_model_dir, seed=7), teacher, source_dir=tiny_model_dir)
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 3})
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "up", str(recipe), "--no-plot",
                          "--up.teacher", str(teacher)], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    orchestrate = read_jsonl(run_dir / "metrics" / "orchestrate.jsonl")
    # The tokens were scored by a teacher of other weights (a sampled KL estimate: either sign).
    assert len(orchestrate) == 3 and all(m["teacher_errors"] == 0 for m in orchestrate)
    assert any(m.get("teacher_kl") for m in orchestrate)
    assert (run_dir / "logs" / "teacher-0.log").is_file()
    assert [e.key for e in list_entries(run_dir / "registry", alive_only=False)] == []
    assert list_entries(run_dir / "teacher" / "registry", alive_only=False) == []  # stopped and deregistered
    bad = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "up", str(recipe), "--no-plot",
                          "--up.teacher", str(tiny_model_dir)], capture_output=True, text=True, timeout=100)
    assert bad.returncode == 2 and "has no safetensors weights" in bad.stderr


def test_a_failed_child_stops_the_run(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 500})
    proc = start_up(recipe, "--no-plot")
    try:
        entries = all_registered(run_dir)
        pids = [e.pid for e in entries]
        infer = next(e for e in entries if e.role == "infer")
        os.kill(infer.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "infer-0 exited with code -9" in err and "infer-0.log" in err
    assert not any(pid_alive(p) for p in pids)


def test_ctrl_c_stops_every_child(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 500})
    proc = start_up(recipe, "--no-plot")
    try:
        entries = all_registered(run_dir)
        wait_until(lambda: (run_dir / "progress" / "train.json").is_file(), 120, "a training step")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert not any(pid_alive(e.pid) for e in entries)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] >= 1


def test_kill_9_on_up_stops_every_child(tmp_path, tiny_model_dir):
    """`up` dies without its cleanup (SIGKILL): each child, in a session of its own, gets SIGTERM
    from the kernel all the same and stops, deregistering."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 500})
    proc = start_up(recipe, "--no-plot")
    entries = []
    try:
        entries = all_registered(run_dir)
        proc.kill()
        proc.communicate(timeout=30)
        wait_until(lambda: not any(pid_alive(e.pid) for e in entries), 60, "every child stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
        for e in entries:
            if pid_alive(e.pid):
                os.kill(e.pid, signal.SIGKILL)
    assert list_entries(run_dir / "registry", alive_only=False) == []  # they stopped cleanly, not killed


def test_gpus_are_placed_as_the_slurm_launcher_places_them(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """Eight GPUs, a 4-rank trainer, 2 servers of tensor parallelism 2: train 0-3, infer-0 4,5, infer-1
    6,7 (each child's CUDA_VISIBLE_DEVICES); too few GPUs, an explicit device index or one GPU: shared."""
    from rlcli.config import load_recipe
    from rlcli.orchestrate import launcher
    from rlcli.transport.rundir import RunDir

    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    over = {"infer.device": "cuda", "infer.engine.name": "vllm", "infer.engine.tensor_parallel_size": 2,
            "up.num_infer": 2, "up.train_nproc_per_node": 4}
    cfg = load_recipe(recipe, overrides=over)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert launcher.visible_gpus() == [str(g) for g in range(8)]
    assert launcher.place_gpus(cfg, launcher.visible_gpus()) == {"train": "0,1,2,3", "infer-0": "4,5",
                                                                "infer-1": "6,7"}
    assert launcher.place_gpus(cfg, ["3", "5", "6", "7", "9", "10", "11", "12", "13"])["infer-1"] == "11,12"
    launcher.log.addHandler(caplog.handler)  # rl-orchestrate's logger may not propagate
    try:
        assert launcher.place_gpus(cfg, [str(g) for g in range(7)]) == {}
    finally:
        launcher.log.removeHandler(caplog.handler)
    assert "7 GPUs cannot give rl-train 4 and 2 rl-infer 2 each: they share" in caplog.text
    assert launcher.place_gpus(load_recipe(recipe, overrides={**over, "infer.device": "cuda:1"}),
                               [str(g) for g in range(8)]) == {}
    assert launcher.place_gpus(load_recipe(recipe, overrides={**over, "up.train_nproc_per_node": 1,
                                                               "up.num_infer": 1}), ["0"]) == {}

    started = {}

    class Recorded:
        def __init__(self, cmd, env, **_):
            command = cmd[cmd.index("-m") + 1].rpartition(".")[2]
            label = f"{command}-{cmd[cmd.index('--id') + 1]}" if "--id" in cmd else command
            started[label] = env.get("CUDA_VISIBLE_DEVICES")
            self.pid = 0

    monkeypatch.setattr(launcher.subprocess, "Popen", Recorded)
    run = RunDir(tmp_path / "run")
    run.claim("t", {})
    launcher.Launcher(cfg, run).start()
    every = "0,1,2,3,4,5,6,7"
    assert started == {"cache": every, "train": "0,1,2,3", "sync": every, "infer-0": "4,5", "infer-1": "6,7",
                       "orchestrate": every}
