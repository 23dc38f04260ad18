"""The 131k-context recipe, dry: it parses, its Slurm plan resolves for every command, its
trainer mesh fits the plan, and long episodes pack into rows of train.micro_batch_tokens."""

import random
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from test_slurm import SLURM, slurm_env

from rlcli.config import load_recipe
from rlcli.parallel.dims import resolve_dims
from rlcli.protocol.batch import pack_rows, split_rows

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "long-context-131k.toml"


def test_recipe_is_a_131k_multi_turn_recipe():
    cfg = load_recipe(RECIPE)
    assert cfg.model.max_seq_len == cfg.env.max_episode_tokens == 131072 <= cfg.train.micro_batch_tokens
    assert cfg.env.name == "tool-use" and cfg.env.max_turns > 1 and cfg.env.truncation == "mask"
    assert cfg.train.parallel.cp > 1


def test_slurm_plan_resolves_for_every_command(tmp_path):
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
    env = slurm_env(tmp_path, hosts, TRAIN_NODES="2", GPUS_PER_NODE="8",
                    RLCLI_ARGS="--orchestrate.num_train_ranks 2")
    plan = subprocess.run(["bash", str(SLURM / "multi-node.sbatch"), str(RECIPE), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=60, check=True).stdout
    bin_dir = Path(sys.executable).parent
    seen = set()
    for line in plan.splitlines():
        _, name, cmd = line.split("\t")
        argv = shlex.split(cmd)
        if argv[0] == "env":  # env CUDA_VISIBLE_DEVICES=... rl-infer ...
            argv = argv[next(i for i, a in enumerate(argv[1:], 1) if "=" not in a):]
        command = argv[0]
        if command in seen:
            continue
        seen.add(command)
        out = subprocess.run([str(bin_dir / command), *argv[1:], "--print-config"], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
        assert out.returncode == 0, (name, out.stderr[-2000:])
        resolved = tomllib.loads(out.stdout)
        assert resolved["model"]["max_seq_len"] == 131072 and resolved["env"]["args"]["max_digits"] == 12
        if command == "rl-train":
            cfg = load_recipe(RECIPE, overrides={"orchestrate.num_train_ranks": 2})
            dims = resolve_dims(cfg.train.parallel, world_size=2 * 8, num_train_ranks=2,
                                micro_batch_tokens=cfg.train.micro_batch_tokens)
            assert (dims.dp, dims.cp) == (2, 8)
    assert seen == {"rl-cache", "rl-sync", "rl-train", "rl-infer", "rl-orchestrate"}


def test_long_episodes_pack_into_rows():
    cfg = load_recipe(RECIPE)
    capacity = cfg.train.micro_batch_tokens
    rng = random.Random(0)
    lengths = [min(131072, int(rng.lognormvariate(9.5, 1.2))) for _ in range(cfg.orchestrate.batch_size
                                                                           * cfg.orchestrate.group_size)]
    lengths[:3] = [131072, 131072, 65536]  # full-budget episodes
    rows = pack_rows(lengths, capacity)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= capacity for row in rows)
    assert [r for r in rows if 0 in r] == [[0]] and [r for r in rows if 1 in r] == [[1]]
    per_rank = split_rows(rows, lengths, 2)
    loads = [sum(lengths[i] for row in rank for i in row) for rank in per_rank]
    assert max(loads) - min(loads) <= max(lengths)  # balanced to within one sequence
