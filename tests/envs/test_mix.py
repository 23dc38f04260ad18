"""env.name = "mix": tasks drawn by weight, each scored (and answered) by the environment that drew it."""

import random
from collections import Counter

import pytest

from rlcli.config.env import EnvConfig
from rlcli.envs import Task, is_multi_turn, make_env
from rlcli.errors import ConfigError


def mix(*members):
    return make_env(EnvConfig(name="mix", args={"envs": list(members)}))


def test_tasks_are_drawn_by_weight_and_tagged():
    env = mix({"name": "reverse", "weight": 3}, {"name": "math", "args": {"verifier": "numeric"}})
    rng = random.Random(0)
    tasks = [env.sample_task(rng) for _ in range(8000)]
    counts = Counter(t.info["env"] for t in tasks)
    assert set(counts) == {"reverse", "math"} and abs(counts["reverse"] / 8000 - 0.75) < 0.02
    again = [t.prompt for t in (mix({"name": "reverse", "weight": 3}, {"name": "math", "args": {
        "verifier": "numeric"}}).sample_task(r) for r in [random.Random(0)])]
    assert again == [tasks[0].prompt]  # the loop's generator decides, nothing else


def test_each_task_is_scored_by_its_own_environment():
    env = mix({"name": "reverse", "args": {"reward": "exact"}}, {"name": "math", "args": {"verifier": "numeric"}})
    rng = random.Random(1)
    tasks = {}
    while len(tasks) < 2:
        t = env.sample_task(rng)
        tasks.setdefault(t.info["env"], t)
    assert env.reward(tasks["reverse"], tasks["reverse"].answer) == 1.0
    assert env.reward(tasks["math"], f"so \\boxed{{{tasks['math'].answer}}}") == 1.0
    assert env.reward(tasks["math"], tasks["reverse"].answer) == 0.0
    with pytest.raises(ValueError, match="not one of the mixture's environments"):
        env.reward(Task(prompt="x", info={"env": "chess"}), "e4")


def test_a_single_turn_member_of_a_multi_turn_mixture_ends_after_one_turn():
    env = mix({"name": "tool-use"}, {"name": "reverse", "args": {"reward": "exact"}})
    assert is_multi_turn(env)
    rng = random.Random(2)
    task = next(t for t in iter(lambda: env.sample_task(rng), None) if t.info["env"] == "reverse")
    messages = [{"role": "assistant", "content": task.answer}]
    assert env.respond(task, messages) is None and env.reward(task, messages) == 1.0
    tool = next(t for t in iter(lambda: env.sample_task(rng), None) if t.info["env"] == "tool-use")
    assert env.respond(tool, [{"role": "assistant", "content": "<calc>2+3</calc>"}]) is not None
    assert not is_multi_turn(mix({"name": "reverse"}, {"name": "longtail"}))


@pytest.mark.parametrize("members, message", [
    ([], "env.args.envs must list at least one environment"),
    ([{"name": "reverse"}, {"name": "reverse"}], "labels must be unique"),
    ([{"name": "reverse", "weight": 0}], "weight must be > 0"),
    ([{"name": "mix", "args": {"envs": [{"name": "reverse"}]}}], "cannot hold another mix"),
    ([{"name": "chess"}], "unknown env.name 'chess'"),
    ([{"name": "reverse", "args": {"min_lenn": 3}}], "min_lenn"),
])
def test_bad_mixtures_are_refused_by_name(members, message):
    with pytest.raises(ConfigError, match=message):
        mix(*members)
