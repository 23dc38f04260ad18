"""The sbatch scripts in a fake Slurm: SLURM_* variables and local stand-ins for srun and scontrol
(tests/fake_slurm) that run each per-node command here. Hosts are loopback addresses."""

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from procs import progress, wait_until, write_recipe

from rlcli.transport.registry import list_entries

REPO = Path(__file__).resolve().parent.parent
SLURM = REPO / "recipes" / "slurm"
FAKE = Path(__file__).resolve().parent / "fake_slurm"

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_env(tmp_path: Path, hosts: list[str], **extra: str) -> dict:
    import sys

    return {**os.environ, "PATH": f"{FAKE}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "SLURM_JOB_NODELIST": f"fake[{len(hosts)}]", "SLURM_NNODES": str(len(hosts)), "SLURM_JOB_ID": "42",
            "SLURM_JOB_NAME": "rlcli", "SLURM_SUBMIT_DIR": str(REPO), "FAKE_SLURM_HOSTS": ",".join(hosts),
            "GPUS_PER_NODE": "1", "BIND_HOST": "127.0.0.1", "RDZV_PORT": str(free_port()),
            "RUN_DIR": str(tmp_path / "run"), **extra}


def sbatch(script: str, recipe: Path, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SLURM / script), str(recipe), *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_dry_run_places_each_command(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    env = slurm_env(tmp_path, ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"], TRAIN_NODES="2",
                    GPUS_PER_NODE="8")
    out = subprocess.run(["bash", str(SLURM / "multi-node.sbatch"), str(recipe), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    plan = [line.split("\t") for line in out.splitlines()]
    where = {name: host for host, name, _ in plan}
    # One rl-infer per GPU of each inference node (tensor_parallel_size 1), ids counting up across nodes.
    assert where == {"cache-0": "10.0.0.1", "sync-0": "10.0.0.1", "orchestrate-0": "10.0.0.1", "train-0": "10.0.0.1",
                     "train-1": "10.0.0.2", **{f"infer-{i}": "10.0.0.3" for i in range(8)},
                     **{f"infer-{i}": "10.0.0.4" for i in range(8, 16)}}
    cmds = {name: cmd for _, name, cmd in plan}
    assert "--nproc-per-node 8 --nnodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:" in cmds["train-1"]
    assert "CUDA_VISIBLE_DEVICES=5 rl-infer" in cmds["infer-13"] and "--id 13 " in cmds["infer-13"]
    # Every command's sockets bind where peers on other nodes reach them (rl-sync's store included).
    for name in ("sync-0", "orchestrate-0", "train-0"):
        assert "--sync.host {0} --orchestrate.host {0} --train.host {0}".format(env["BIND_HOST"]) in cmds[name]
    tp2 = subprocess.run(["bash", str(SLURM / "multi-node.sbatch"), str(recipe), "--dry-run"],
                         env={**env, "RLCLI_ARGS": "--infer.engine.name vllm --infer.engine.tensor_parallel_size 2"},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    tp2 = {name: cmd for _, name, cmd in (line.split("\t") for line in tp2.splitlines())}
    assert sorted(n for n in tp2 if n.startswith("infer-")) == sorted(f"infer-{i}" for i in range(8))
    assert "CUDA_VISIBLE_DEVICES=6,7 rl-infer" in tp2["infer-3"] and "CUDA_VISIBLE_DEVICES=0,1 rl-infer" in tp2["infer-4"]
    few = subprocess.run(["bash", str(SLURM / "single-node.sbatch"), str(recipe), "--dry-run"],
                         env={**env, "FAKE_SLURM_HOSTS": "10.0.0.9", "SLURM_NNODES": "1", "TRAIN_GPUS": "6",
                              "RLCLI_ARGS": "--infer.engine.name vllm --infer.engine.tensor_parallel_size 4"},
                         capture_output=True, text=True, timeout=60)
    assert few.returncode == 2 and "tensor_parallel_size=4 GPUs but 10.0.0.9 has 2 for it" in few.stderr
    single = subprocess.run(["bash", str(SLURM / "single-node.sbatch"), str(recipe), "--dry-run"],
                            env={**env, "FAKE_SLURM_HOSTS": "10.0.0.9", "SLURM_NNODES": "1"},
                            capture_output=True, text=True, timeout=60, check=True).stdout
    cmds = {name: cmd for _, name, cmd in (line.split("\t") for line in single.splitlines())}
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 rl-train" in cmds["train-0"]
    assert [cmds[f"infer-{i}"].split()[1] for i in range(4)] == [f"CUDA_VISIBLE_DEVICES={g}" for g in range(4, 8)]
    bad = subprocess.run(["bash", str(SLURM / "multi-node.sbatch"), str(recipe), "--dry-run"],
                         env={**env, "TRAIN_NODES": "4"}, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "TRAIN_NODES=4 + INFER_NODES=0" in bad.stderr


def test_dry_run_on_one_gpu_node_shares_gpu_0(tmp_path, tiny_model_dir):
    """GPUS_PER_NODE=1: rl-infer gets GPU 0 beside rl-train (it once got an empty CUDA_VISIBLE_DEVICES,
    i.e. no GPU); a TRAIN_GPUS that leaves rl-infer no GPU is refused, naming TRAIN_GPUS."""
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    env = slurm_env(tmp_path, ["10.0.0.9"], GPUS_PER_NODE="1")
    out = subprocess.run(["bash", str(SLURM / "single-node.sbatch"), str(recipe), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    cmds = {name: cmd for _, name, cmd in (line.split("\t") for line in out.splitlines())}
    assert "env CUDA_VISIBLE_DEVICES=0 rl-train " in cmds["train-0"] and "--nproc-per-node 1 " in cmds["train-0"]
    assert "env CUDA_VISIBLE_DEVICES=0 rl-infer " in cmds["infer-0"]
    for gpus, train in (("1", "2"), ("8", "8")):
        bad = subprocess.run(["bash", str(SLURM / "single-node.sbatch"), str(recipe), "--dry-run"],
                             env={**env, "GPUS_PER_NODE": gpus, "TRAIN_GPUS": train}, capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and f"TRAIN_GPUS={train} does not fit GPUS_PER_NODE={gpus}" in bad.stderr


@pytest.mark.parametrize("script,hosts", [("single-node.sbatch", ["127.0.0.1"]),
                                          ("multi-node.sbatch", ["127.0.0.1", "127.0.0.2"])])
def test_a_run_starts_coordinates_and_ends(script, hosts, tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run", top={"num_steps": 2})
    job = sbatch(script, recipe, slurm_env(tmp_path, hosts))
    try:
        out, err = job.communicate(timeout=400)
    finally:
        if job.poll() is None:  # a timed-out job takes every process it started with it
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, err[-4000:]
    assert "run complete" in err and progress(tmp_path / "run", "train") == 2
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    # One log per process, each its own (the processes see their stderr is the file and add none).
    assert logs == ["cache-0.log", "infer-0.log", "orchestrate-0.log", "sync-0.log", "train-0.log"]


def test_a_killed_component_fails_the_job_naming_it(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 500})
    job = sbatch("multi-node.sbatch", recipe, slurm_env(tmp_path, ["127.0.0.1", "127.0.0.2"]))
    try:
        entry = wait_until(lambda: list_entries(run_dir / "registry", "infer"), 180, "rl-infer registered")[0]
        os.kill(entry.pid, signal.SIGKILL)
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0
    assert "rlcli-slurm: error: infer-0 on 127.0.0.2 exited with code" in err, err[-3000:]
    # Every other process was stopped: those that registered are gone (the killed one could not deregister).
    others = [e for e in list_entries(run_dir / "registry", alive_only=False) if e.key != "infer-0"]
    for e in others:
        with pytest.raises(ProcessLookupError):
            os.kill(e.pid, 0)
