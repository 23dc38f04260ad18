"""Scheduled evaluation (orchestrate.eval): which served versions get a round, what a restart skips,
and how a round with lost tasks is recorded. The rounds beside a live loop: tests/test_e2e.py."""

import pytest
from procs import read_jsonl, write_recipe

from rlcli.config import load_recipe
from rlcli.errors import ConfigError
from rlcli.models.tokenizer import load_tokenizer
from rlcli.orchestrate.evaluation import Evaluation
from rlcli.protocol import Completion
from rlcli.transport.rundir import RunDir
from rlcli.envs import make_env


def evaluation(tmp_path, tiny_model_dir, **eval_table):
    run_dir = tmp_path / "run"
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 9},
                                   orchestrate={"eval": {"interval": 3, "num_tasks": 4, "samples": 2, **eval_table}}))
    return Evaluation(cfg, RunDir(run_dir), make_env(cfg.env), load_tokenizer(cfg.model.path))


def finish(ev, version, rewards):
    for group, r in zip(ev.start(version), rewards):
        group.completions = [Completion(token_ids=[5, 6], logprobs=[0.0, 0.0], versions=[version, version + 1],
                                        finish_reason="stop") for _ in r]
        group.rewards = list(r)
        ev.scored(group)


def test_policy_0_each_multiple_crossed_and_the_final_policy_are_due(tmp_path, tiny_model_dir):
    ev = evaluation(tmp_path, tiny_model_dir)
    assert ev.due(0) and ev.waiting_for_final()
    finish(ev, 0, [[0.0, 1.0]] * 4)
    assert [v for v in range(1, 10) if ev.due(v)] == [3, 4, 5, 6, 7, 8, 9]  # from 3 on, even if 3 is never served
    finish(ev, 4, [[1.0, 1.0]] * 4)
    assert [v for v in range(5, 10) if ev.due(v)] == [6, 7, 8, 9]
    finish(ev, 9, [[1.0, 0.0]] * 4)
    assert not ev.waiting_for_final()
    evals = read_jsonl(ev.run.metrics_file("eval"))
    assert [m["step"] for m in evals] == [0, 4, 9]
    assert evals[0]["pass@1"] == 0.5 and evals[0]["pass@2"] == 1.0 and evals[1]["pass@1"] == 1.0
    assert evals[1]["token_version_min"] == 4 and evals[1]["token_version_max"] == 5  # a swap mid-round
    # A restarted rl-orchestrate takes up the schedule where eval.jsonl leaves it.
    again = evaluation(tmp_path, tiny_model_dir)
    assert not again.due(0) and not again.due(4) and not again.waiting_for_final()
    assert again.tasks == ev.tasks  # the same tasks every time


def test_without_final_the_run_does_not_wait_and_lost_tasks_are_counted(tmp_path, tiny_model_dir):
    ev = evaluation(tmp_path, tiny_model_dir, final=False)
    assert not ev.waiting_for_final()
    groups = ev.start(0)
    groups[0].completions = [Completion(token_ids=[5], logprobs=[0.0], versions=[0], finish_reason="stop")] * 2
    groups[0].rewards = [1.0, 1.0]
    ev.scored(groups[0])
    ev.sweep(groups[1:2])  # one still pending, two gone (rejected by the server, dropped by an HTTP environment)
    assert ev.running
    groups[1].completions, groups[1].rewards = groups[0].completions, [0.0, 0.0]
    ev.scored(groups[1])
    assert not ev.running
    [m] = read_jsonl(ev.run.metrics_file("eval"))
    assert m["num_tasks"] == 2 and m["num_tasks_lost"] == 2 and m["pass@1"] == 0.5
    lines = read_jsonl(ev.run.root / "evals" / "policy_0.jsonl")
    assert [r["rewards"] for r in lines] == [[1.0, 1.0], [0.0, 0.0]] and lines[0]["prompt"] == groups[0].task.prompt


@pytest.mark.parametrize("table, message", [
    ({"interval": -1}, "orchestrate.eval.interval must be >= 0"),
    ({"samples": 0}, "orchestrate.eval.num_tasks and orchestrate.eval.samples must be >= 1"),
    ({"temperature": 0.0}, "orchestrate.eval.temperature must be > 0"),
    ({"max_tokens": -2}, "orchestrate.eval.max_tokens must be >= 0"),
])
def test_bad_settings_are_refused_by_name(tmp_path, tiny_model_dir, table, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run", orchestrate={"eval": table}))
