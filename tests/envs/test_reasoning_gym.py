"""The reasoning-gym adapter: tasks are the library's entries, rewards its own score_answer."""

import random

import pytest

from rlcli.config import load_recipe
from rlcli.envs import is_dataset, make_env

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym is the `reasoning-gym` extra")


@pytest.mark.parametrize("dataset, config", [("basic_arithmetic", {"min_terms": 2, "max_terms": 3}),
                                             ("leg_counting", {}), ("word_sorting", {})])
def test_rewards_match_the_librarys_scoring(dataset, config):
    from reasoning_gym.utils import extract_answer

    cfg = load_recipe(None, {}, {"env.name": "reasoning-gym",
                                 "env.args": {"dataset": dataset, "size": 50, "seed": 7, "config": config}})
    env = make_env(cfg.env)
    reference = rg.create_dataset(dataset, size=50, seed=7, **config)  # built apart from the adapter
    by_question = {entry["question"]: entry for entry in reference}
    rng = random.Random(0)
    for _ in range(8):
        task = env.sample_task(rng)
        entry = next(e for q, e in by_question.items() if task.prompt.endswith("\n" + q))
        for completion in (f"Thinking... <answer>{entry['answer']}</answer>", "<answer>0</answer>",
                           "no tags at all", f"<answer> {entry['answer']} </answer> <answer>wrong</answer>"):
            expected = reference.score_answer(answer=extract_answer(completion), entry=entry)
            assert env.reward(task, completion) == pytest.approx(expected), (dataset, completion)
        assert env.reward(task, f"<answer>{entry['answer']}</answer>") == 1.0
    # A dataset environment (drawn in epochs by rl-orchestrate): task(i) is entry i.
    assert is_dataset(env) and env.num_tasks == 50
    assert all(env.task(i).prompt.endswith("\n" + e["question"]) for i, e in enumerate(reference))


def test_unknown_dataset_names_the_key():
    from rlcli.errors import ConfigError

    cfg = load_recipe(None, {}, {"env.name": "reasoning-gym", "env.args": {"dataset": "no_such_task"}})
    with pytest.raises(ConfigError, match="env.args.dataset='no_such_task'"):
        make_env(cfg.env)
