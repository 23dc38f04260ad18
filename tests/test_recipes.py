"""Dry runs of the real-model recipes, without their weights.

Each recipe names a downloaded HF model directory; recipes/models/<name>-config holds the same
config.json. The dry run builds the architecture on the meta device from it (its size must be the
published one), checks FP8 and routing-replay settings against the model, resolves the parallel
layout for the Slurm placement the recipe's header gives, and runs that sbatch script's --dry-run
in a fake Slurm (tests/fake_slurm) to check where each command goes and how many rollout files
per step the orchestrator writes.
"""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlcli.config import load_recipe
from rlcli.models.config import ModelArgs
from rlcli.models.hf_io import build_model
from rlcli.parallel.dims import resolve_dims

REPO = Path(__file__).resolve().parent.parent
FAKE = Path(__file__).resolve().parent / "fake_slurm"


@dataclass
class Case:
    recipe: str
    config_dir: str
    params_b: float        # published total parameters, billions
    active_b: float        # per token (experts counted k / E), billions, embeddings included
    script: str            # the sbatch script of the recipe's header, and its node counts
    nodes: int
    train_nodes: int
    dp: int                # expected data-parallel degree = rollout files per step


CASES = [
    Case("qwen3-0.6b-reverse.toml", "qwen3-0.6b-config", 0.596, 0.596, "single-node.sbatch", 1, 0, 4),
    Case("qwen3-30b-a3b-math.toml", "qwen3-30b-a3b-config", 30.5, 3.35, "multi-node.sbatch", 3, 2, 16),
    Case("glm-4.5-air-131k.toml", "glm-4.5-air-config", 106.9, 13.4, "multi-node.sbatch", 5, 4, 8),
]


def sizes(model, args: ModelArgs) -> tuple[float, float]:
    total = active = 0.0
    for name, p in model.named_parameters():
        total += p.numel()
        active += p.numel() * (args.num_experts_per_tok / args.num_experts if ".experts." in name else 1)
    return total / 1e9, active / 1e9


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.recipe)
def test_recipe_dry_run(case: Case, tmp_path):
    cfg = load_recipe(REPO / "recipes" / case.recipe, {"model.path": str(REPO / "recipes/models" / case.config_dir)})
    args = ModelArgs.from_dir(cfg.model.path)
    model = build_model(args, materialize=False)
    total, active = sizes(model, args)
    assert total == pytest.approx(case.params_b, rel=0.01) and active == pytest.approx(case.active_b, rel=0.01)
    assert cfg.model.max_seq_len <= args.max_position_embeddings
    assert cfg.r3 == bool(args.num_experts)  # routing replay on every MoE recipe

    world = case.train_nodes * 8 if case.nodes > 1 else 4  # single node: half of its 8 GPUs train
    dims = resolve_dims(cfg.train.parallel, world, args.num_experts, case.dp, cfg.train.micro_batch_tokens)
    assert (dims.dp, dims.cp, dims.ep) == (case.dp, cfg.train.parallel.cp, cfg.train.parallel.ep)

    if cfg.train.fp8.enabled:
        from rlcli.ops.fp8.convert import convert_to_fp8

        assert cfg.infer.fp8 == cfg.train.fp8  # the engine quantizes the same GEMMs as the trainer
        converted = convert_to_fp8(model, cfg.train.fp8, device="cpu")
        assert sum(n.endswith(".mlp.experts") for n in converted) == args.num_hidden_layers
        assert not any(n.endswith((".mlp.gate", "lm_head")) for n in converted)

    plan = slurm_plan(case, tmp_path)
    trainers = [cmd for name, (_, cmd) in plan.items() if name.startswith("train")]
    assert len(trainers) == max(case.train_nodes, 1)
    assert all(f"--orchestrate.num_train_ranks {case.dp} " in cmd for _, cmd in plan.values())
    assert all(f"--nproc-per-node {8 if case.nodes > 1 else 4} " in cmd for cmd in trainers)
    infer_hosts = {host for name, (host, _) in plan.items() if name.startswith("infer")}
    assert infer_hosts == ({"10.0.0.1"} if case.nodes == 1 else
                           {f"10.0.0.{i + 1}" for i in range(case.train_nodes, case.nodes)})
    infer_gpus = 4 if case.nodes == 1 else 8 * (case.nodes - case.train_nodes)  # one rl-infer per tp GPUs
    tp = getattr(cfg.infer.engine, "tensor_parallel_size", 1)
    assert sum(name.startswith("infer") for name in plan) == infer_gpus // tp


def slurm_plan(case: Case, tmp_path: Path, **extra: str) -> dict[str, tuple[str, str]]:
    """process name -> (host, command) from the recipe's sbatch script with --dry-run."""
    hosts = [f"10.0.0.{i + 1}" for i in range(case.nodes)]
    env = {**os.environ, "PATH": f"{FAKE}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": f"fake[{case.nodes}]", "SLURM_NNODES": str(case.nodes), "SLURM_JOB_ID": "1",
           "FAKE_SLURM_HOSTS": ",".join(hosts), "GPUS_PER_NODE": "8", "RUN_DIR": str(tmp_path / "run"), **extra}
    if case.train_nodes:
        env["TRAIN_NODES"] = str(case.train_nodes)
    out = subprocess.run(["bash", str(REPO / "recipes/slurm" / case.script), f"recipes/{case.recipe}", "--dry-run"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {name: (host, cmd + " ") for host, name, cmd in (line.split("\t") for line in out.stdout.splitlines())}


def test_launcher_takes_dp_from_the_resolved_recipe(tmp_path):
    """RLCLI_ARGS overrides reach the rollout-file count: --train.parallel.cp 8 on 32 ranks is dp 4."""
    plan = slurm_plan(CASES[2], tmp_path, RLCLI_ARGS="--train.parallel.cp 8")
    assert all("--orchestrate.num_train_ranks 4 " in cmd for _, cmd in plan.values())
