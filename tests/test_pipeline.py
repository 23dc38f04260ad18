"""The README's pipeline (tasks | generate | score | jq, and eval) runs against a live rl-infer."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from procs import Procs, serve_initial_policy, wait_until, write_recipe

from rlcli.orchestrate.pipeline import pass_at_k, summarize_eval
from rlcli.transport.registry import list_entries

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def readme_pipeline() -> str:
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- pipeline-example", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return block


def test_pass_at_k():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)


def test_eval_counts_a_pass_at_the_threshold_and_names_the_policies():
    """`rl-orchestrate eval`'s summary: a completion passes when its reward >= --threshold (equal
    counts), pass@1 and pass@k are means over tasks, and the policy versions seen are listed."""
    scored = [{"rewards": [1.0, 0.5], "reward_mean": 0.75, "versions": [[3, 3], [3, 4]]},
              {"rewards": [0.25, 0.0], "reward_mean": 0.125, "versions": [[4]]}]
    out = summarize_eval(scored, 2, 1.0)
    assert out["pass@1"] == pytest.approx(0.25) and out["pass@2"] == pytest.approx(0.5)
    assert out["policy_versions"] == [3, 4] and out["reward_mean"] == pytest.approx(0.4375)
    out = summarize_eval(scored, 2, 0.5)  # the 0.5 passes now
    assert out["pass@1"] == pytest.approx(0.5) and out["pass@2"] == pytest.approx(0.5)
    assert summarize_eval(scored, 2, 0.25)["pass@2"] == 1.0


def test_readme_pipeline_runs(tmp_path, tiny_model_dir):
    if not shutil.which("jq"):
        pytest.skip("jq is not installed")
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir)
    serve_initial_policy(run_dir, tiny_model_dir)
    procs = Procs(tmp_path / "logs")
    try:
        procs.start("infer-0", recipe, "--id", "0")
        wait_until(lambda: list_entries(run_dir / "registry", "infer"), 120, "rl-infer registered", procs)
        script = readme_pipeline().replace("runs/reverse", str(run_dir))
        out = subprocess.run(["bash", "-o", "pipefail", "-c", script], capture_output=True, text=True, timeout=300,
                             env={"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(tmp_path),
                                  **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}})
        assert out.returncode == 0, out.stderr
        mean_reward, pass4 = (float(x) for x in out.stdout.split())
        assert 0.0 <= mean_reward <= 1.0 and 0.0 <= pass4 <= 1.0

        # The same stages, kept apart: every field travels, one reward per completion.
        tasks = subprocess.run([BIN / "rl-orchestrate", "tasks", "--env", "reverse", "-n", "3"], capture_output=True,
                               text=True, timeout=120, check=True).stdout
        generated = subprocess.run([BIN / "rl-infer", "generate", "--run-dir", str(run_dir), "--json", "--n", "2",
                                    "--max-tokens", "8"], input=tasks, capture_output=True, text=True, timeout=120,
                                   check=True).stdout
        scored = [json.loads(line) for line in subprocess.run(
            [BIN / "rl-orchestrate", "score", "--env", "reverse"], input=generated, capture_output=True, text=True,
            timeout=120, check=True).stdout.splitlines()]
        for task, rec in zip((json.loads(t) for t in tasks.splitlines()), scored, strict=True):
            assert rec["answer"] == task["answer"] == task["prompt"][:-1][::-1]
            assert len(rec["completions"]) == len(rec["rewards"]) == 2 and rec["versions"] == [[0] * len(v) for v
                                                                                             in rec["versions"]]
    finally:
        procs.stop_all()


def test_score_refuses_what_it_cannot_read(tmp_path):
    for text, needle in (("not json\n", "stdin line 1 is not JSON"), ('{"prompt": "a="}\n', "needs 'prompt' and "
                                                                      "'completions'")):
        out = subprocess.run([BIN / "rl-orchestrate", "score", "--env", "reverse"], input=text, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2 and needle in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_score_runs_a_failed_reward_again_up_to_env_retries(tmp_path, monkeypatch, caplog):
    import logging

    from rlcli.config.env import EnvConfig
    from rlcli.orchestrate.pipeline import score_records

    (tmp_path / "flakyenv.py").write_text('''
from rlcli.envs import Task


class Flaky:
    calls = 0

    def sample_task(self, rng):
        return Task(prompt="a=")

    def reward(self, task, text):
        Flaky.calls += 1
        if Flaky.calls % 3:
            raise ConnectionError("judge hung up")
        return 1.0
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    records = [{"prompt": "a=", "completions": ["x", "y"]}]
    with caplog.at_level(logging.WARNING, logger="rlcli.envs"):
        [twice] = score_records(EnvConfig(name="flakyenv:Flaky", retries=2, on_error=-1.0), records)
        [once] = score_records(EnvConfig(name="flakyenv:Flaky", retries=1, on_error=-1.0), records)
    assert twice["rewards"] == [1.0, 1.0]  # each passed on its third attempt
    assert once["rewards"] == [-1.0, 1.0]  # calls 7, 8 fail; 9 passes
    assert sum("trying again" in r.getMessage() for r in caplog.records) == 4 + 1
