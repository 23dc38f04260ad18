"""Launching and mesh checks: the lines a user sees for a bad --dp/--ep/--cp, Slurm rendezvous."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import write_recipe
from rlcli.cli.torchrun import expand_nodelist, strip_launch_flags, torchrun_command, world_size
from rlcli.config.train import ParallelConfig
from rlcli.errors import ConfigError
from rlcli.process import children
from rlcli.parallel.dims import resolve_dims


@pytest.mark.parametrize("kw,world,experts,message", [
    (dict(dp=3, cp=2), 4, 0, "--dp 3 --cp 2 needs 6 ranks, torchrun gave 4"),
    (dict(cp=3), 4, 0, "--cp 3 does not divide the 4 ranks"),
    (dict(ep=2), 2, 0, "--ep 2 needs a mixture-of-experts model"),
    (dict(ep=4, dp=2), 2, 8, "--ep 4 must divide --dp x --cp = 2"),
    (dict(ep=2, dp=2), 2, 5, "--ep 2 must divide the model's 5 experts"),
])
def test_bad_meshes_name_the_flags(kw, world, experts, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_dims(ParallelConfig(**kw), world, experts)


def test_mesh_checks_num_train_ranks_and_cp_against_the_row():
    with pytest.raises(ConfigError, match=r"orchestrate.num_train_ranks \(1\) must equal train.parallel.dp \(2\)"):
        resolve_dims(ParallelConfig(), 2, num_train_ranks=1)
    with pytest.raises(ConfigError, match="--cp 4 cuts each row into 8 chunks, more than train.micro_batch_tokens"):
        resolve_dims(ParallelConfig(cp=4), 4, micro_batch_tokens=6)
    d = resolve_dims(ParallelConfig(cp=2, ep=2), 8, num_experts=8, num_train_ranks=4)
    assert (d.dp, d.cp, d.ep, d.fsdp_size) == (4, 2, 2, 8)
    assert [d.coords(r) for r in (0, 1, 2, 7)] == [(0, 0), (0, 1), (1, 0), (3, 1)]


def test_a_rank_without_a_gpu_is_refused_with_the_fix(monkeypatch):
    """More ranks per node than GPUs: one line naming the fix, not CUDA's "invalid device ordinal"."""
    import torch

    from rlcli.parallel.dist import init_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="local rank 1 has no GPU: this host shows 1; run at most that many ranks"):
        init_distributed()


def test_slurm_nodelists_expand_like_scontrol():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("node7") == ["node7"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]


def test_torchrun_command_from_slurm_and_flags():
    args = strip_launch_flags(["--config", "r.toml", "--nproc-per-node", "8", "--nnodes=2", "--ep", "8"])
    assert args == ["--config", "r.toml", "--ep", "8"]
    slurm = {"SLURM_JOB_NODELIST": "gpu[12-13]", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "77"}
    cmd = torchrun_command(8, None, None, None, args, env=slurm)
    i = cmd.index("rlcli.cli.torchrun")
    assert cmd[i + 1:i + 11] == ["--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                 "gpu12", "--master-port", "29500"]
    assert cmd[-6:] == ["rlcli.cli.train", "run", "--config", "r.toml", "--ep", "8"]
    assert world_size(8, None, env=slurm) == 16
    assert "--standalone" in torchrun_command(2, None, None, None, [], env={})
    cmd = torchrun_command(4, 3, None, "h:1234", [], env={})
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "h:1234" and cmd[cmd.index("--nnodes") + 1] == "3"


def test_rl_train_refuses_a_bad_mesh_before_launching(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    for flags, needle in [(["--dp", "3", "--cp", "2"], "--dp 3 --cp 2 needs 6 ranks, torchrun gave 4"),
                          (["--ep", "2"], "--ep 2 needs a mixture-of-experts model"),
                          (["--sync.backend.kind", "collective", "--sync.backend.senders", "8", "--dp", "2", "--cp", "2",
                            "--orchestrate.num_train_ranks", "2"],
                           "sync.backend.senders = 8 is more than the trainer's 4 ranks; set it to at most 4")]:
        out = subprocess.run([sys.executable, "-m", "rlcli.cli.train", "--config", str(recipe), "--nproc-per-node",
                              "4", *flags], capture_output=True, text=True, timeout=120)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and len(lines) == 1 and needle in lines[0], out.stderr



def test_a_usage_error_the_ranks_find_is_one_line_and_exit_2(tmp_path, tiny_model_dir):
    """An error found after the relaunch (here: the run directory is another recipe's) is said once by
    the ranks; torchrun's traceback and report, and its exit 1, used to follow it."""
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text('{"name": "other", "fingerprint": "x", "identity": {}}')
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.train", "--config", str(recipe), "--nproc-per-node", "2",
                          "--orchestrate.num_train_ranks", "2"], capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "belongs to recipe 'other'" in lines[0], out.stderr


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_torchrun_takes_its_ranks_with_it(tmp_path, tiny_model_dir):
    """torchrun puts each rank in a session of its own, so SIGKILL to torchrun's process group (a
    scheduler's timeout, a bench's killpg) reaches torchrun alone. The ranks, waiting for their
    first batch, must not outlive it."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, orchestrate={"num_train_ranks": 2})
    log = (tmp_path / "train.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "rlcli.cli.train", "--config", str(recipe), "--nproc-per-node",
                             "2"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        # Both ranks up and past their start-up (a rank has written the run's train config).
        while time.monotonic() < deadline and not (len(ranks) == 2 and any(run_dir.rglob("*train*.toml"))):
            assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            ranks = children(proc.pid)
            time.sleep(0.2)
        assert len(ranks) == 2, f"ranks {ranks}; log: {(tmp_path / 'train.log').read_text()[-3000:]}"
        time.sleep(2.0)
        assert all(_alive(r) for r in ranks)
        # Rank 0 keeps its log in the run as well (its stderr here is another file).
        assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["train-0.log"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(r) for r in ranks):
            time.sleep(0.1)
        assert not any(_alive(r) for r in ranks), "ranks outlived their torchrun"
    finally:
        for r in ranks:
            try:
                os.kill(r, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("how,code,said", [("exit", 3, "rank 1 (pid {pid}) exited with code 3"),
                                           ("kill", 137, "rank 1 (pid {pid}) was killed by SIGKILL"),
                                           ("usage", 2, None)])
def test_a_failed_rank_is_said_in_one_line(tmp_path, how, code, said):
    """rl-train's torchrun: no traceback or report of torchrun's own, one line naming the rank (its
    output says why); a usage error (exit 2) was said by the rank itself and passes on silently."""
    script = tmp_path / "rank.py"
    script.write_text(f"""
import os, signal, sys
if os.environ["RANK"] == "1":
    print("pid", os.getpid(), file=sys.stderr, flush=True)
    if {how!r} == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3 if {how!r} == "exit" else 2)
""")
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.torchrun", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == code, out.stderr
    pid = next(line.split()[1] for line in out.stderr.splitlines() if line.startswith("pid "))
    rest = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("pid ")]
    assert rest == ([] if said is None else [f"rl-train: error: {said.format(pid=pid)}; its output above says why"]), \
        out.stderr
