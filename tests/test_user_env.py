"""A user's environment from outside rlcli: the README's module, written into a temporary
directory, named by package.module:factory in a recipe, runs the whole loop."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from procs import read_jsonl, write_recipe

from rlcli.protocol.batch import decode_batch

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def readme_blocks() -> tuple[str, str]:
    text = (REPO / "README.md").read_text().split("<!-- user-env-example", 1)[1]
    module = text.split("```python\n", 1)[1].split("```", 1)[0]
    recipe = text.split("```toml\n", 1)[1].split("```", 1)[0]
    return module, recipe


def test_readme_environment_runs_the_loop(tmp_path, tiny_model_dir):
    module, recipe_toml = readme_blocks()
    assert len(module.splitlines()) + len(recipe_toml.splitlines()) < 20
    user = tmp_path / "user"
    user.mkdir()
    (user / "my_env.py").write_text(module)
    env = tomllib.loads(recipe_toml)["env"]
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, env=env)
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "up", str(recipe), "--no-plot",
                          "--steps", "3"], cwd=user, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(run_dir / "metrics" / "train.jsonl")] == [1, 2, 3]
    batch = decode_batch((run_dir / "rollouts" / "step_1" / "0.msgpack").read_bytes())
    ids = batch.micro_batches[0].input_ids.numpy()
    start = (batch.micro_batches[0].position_ids.numpy() == 0).nonzero()[0]
    prompt = bytes(int(t) for t in ids[start[0] + 1:] if t < 256).split(b"=")[0]  # byte tokenizer, <bos> first
    assert prompt.isdigit() and 1 <= int(prompt) <= 9  # Countdown's prompts, start = 9
