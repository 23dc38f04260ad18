"""recipes/tool-use.toml, shrunk, through `rl-orchestrate up`: multi-turn tool-use episodes on the
tiny model, every process live; the environment's turns reach the trainer as context only."""

import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from procs import read_jsonl

from rlcli.config import dump_toml
from rlcli.protocol.batch import decode_batch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_tool_use_recipe_runs_multi_turn_episodes(tmp_path, tiny_model_dir):
    tree = tomllib.loads((REPO / "recipes" / "tool-use.toml").read_text())
    tree.update(num_steps=2, run_dir=str(tmp_path / "run"))
    tree["model"]["path"] = str(tiny_model_dir)
    tree["env"]["max_turns"] = 2
    tree["orchestrate"].update(batch_size=2, group_size=2)
    tree["orchestrate"]["sampling"]["max_tokens"] = 8
    recipe = tmp_path / "tool-use.toml"
    recipe.write_text(dump_toml(tree))
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "up", str(recipe), "--no-plot"],
                         capture_output=True, text=True, timeout=280, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    orch = read_jsonl(tmp_path / "run" / "metrics" / "orchestrate.jsonl")
    train = read_jsonl(tmp_path / "run" / "metrics" / "train.jsonl")
    assert [m["step"] for m in train] == [1, 2]
    assert sum(m["env_turns"] for m in orch) > 0 and all(m["env_errors"] == 0 for m in orch)
    assert [m["num_loss_tokens"] for m in train] == [m["num_loss_tokens"] for m in orch]
    batch = decode_batch((tmp_path / "run" / "rollouts" / "step_1" / "0.msgpack").read_bytes())
    context_inside = 0  # environment tokens between model turns: masked, no version
    for mb in batch.micro_batches:
        mask, pos, versions = mb.loss_mask.numpy(), mb.position_ids.numpy(), mb.versions.numpy()
        starts = list(np.flatnonzero(pos == 0)) + [len(pos)]
        for s, e in zip(starts, starts[1:]):
            m = mask[s:e]
            first = int(np.argmax(m))
            last = len(m) - int(np.argmax(m[::-1]))
            context_inside += int((~m[first:last]).sum())
        assert (versions[~mask] == -1).all() and (versions[mask] >= 0).all()
    assert context_inside > 0
