"""Built-in environments and the registry: env.name resolution, env.args checks, math and tool use."""

import random
import sys
import textwrap

import pytest

from rlcli.config import load_recipe
from rlcli.config.load import parse_overrides
from rlcli.envs import is_multi_turn, make_env
from rlcli.envs.math import numeric_score
from rlcli.envs.tools import ToolUseEnv, calculate
from rlcli.errors import ConfigError


def env_from(*overrides: str):
    return make_env(load_recipe(None, {}, parse_overrides(list(overrides))).env)


def test_old_env_keys_move_into_env_args_and_unknown_ones_name_the_new_key():
    cfg = load_recipe(None, {}, parse_overrides(["--env.name", "longtail", "--env.sigma", "2"]))
    assert cfg.env.args == {"sigma": 2}
    with pytest.raises(ConfigError, match=r"unknown key 'env.bogus'.*env.args.bogus"):
        load_recipe(None, {}, parse_overrides(["--env.bogus", "1"]))
    with pytest.raises(ConfigError, match=r"env reverse: env.args: unknown key 'bogus'"):
        env_from("--env.args.bogus", "1")
    with pytest.raises(ConfigError, match=r"env.args.min_len"):
        env_from("--env.args.min_len", "9")


def test_an_override_beats_the_recipes_old_style_env_key_in_either_spelling(tmp_path):
    """A recipe with `min_len` directly in [env] (before env.args): --env.args.min_len and
    --env.min_len both win over it (the recipe's keys move into env.args before overrides apply)."""
    recipe = tmp_path / "r.toml"
    recipe.write_text('[env]\nname = "reverse"\nmin_len = 3\nmax_len = 6\n')
    for key in ("--env.args.min_len", "--env.min_len"):
        assert load_recipe(recipe, {}, parse_overrides([key, "4"])).env.args == {"min_len": 4, "max_len": 6}, key
    assert load_recipe(recipe).env.args == {"min_len": 3, "max_len": 6}


def test_module_factory_and_entry_points(tmp_path, monkeypatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "envs.py").write_text(textwrap.dedent("""
        from rlcli.envs import Task

        class Echo:
            def __init__(self, word="hi"):
                self.word = word
            def sample_task(self, rng):
                return Task(prompt=self.word, answer=self.word)
            def reward(self, task, completion):
                return float(completion == task.answer)

        def make(word="hi"):
            return Echo(word)
    """))
    dist = tmp_path / "userpkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: userpkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[rlcli.envs]\necho = userpkg.envs:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = env_from("--env.name", "userpkg.envs:make", "--env.args.word", "yo")
    assert env.sample_task(random.Random(0)).prompt == "yo"
    env = env_from("--env.name", "echo", "--env.args.word", "ep")  # the entry point, found by name
    assert env.reward(env.sample_task(random.Random(0)), "ep") == 1.0
    with pytest.raises(ConfigError, match="env.args do not fit"):
        env_from("--env.name", "userpkg.envs:make", "--env.args.colour", "red")
    with pytest.raises(ConfigError, match="cannot import"):
        env_from("--env.name", "nopkg.nomodule:make")
    with pytest.raises(ConfigError, match="no attribute"):
        env_from("--env.name", "userpkg.envs:missing")
    sys.modules.pop("userpkg.envs", None)


def test_math_numeric_verifier():
    env = env_from("--env.name", "math", "--env.args.verifier", "numeric")
    rng = random.Random(0)
    for _ in range(20):
        task = env.sample_task(rng)
        value = task.info["value"]
        assert env.reward(task, f"so \\boxed{{{value}}}") == 1.0
        assert env.reward(task, "\\boxed{123456789}") == 0.0
    assert numeric_score("3/4", "\\boxed{\\frac{3}{4}}") == 1.0 and numeric_score("2", "I do not know") == 0.0


def test_math_verify_agrees_with_its_own_verify():
    pytest.importorskip("math_verify", reason="math-verify is the `math` extra")
    from math_verify import parse, verify

    env = env_from("--env.name", "math")
    rng = random.Random(1)
    for _ in range(12):
        task = env.sample_task(rng)
        for completion in (f"The answer is $\\boxed{{{task.answer}}}$.", f"\\boxed{{{task.info['value']}}}",
                           "\\boxed{987654}", "no idea"):
            expected = float(verify(parse(f"${task.answer}$"), parse(completion)))
            assert env.reward(task, completion) == expected
        assert env.reward(task, f"\\boxed{{{task.info['value']}}}") == 1.0


def test_calculator_and_tool_turns():
    assert calculate("2 * (3 + 4) - 10 / 4") == 11.5 and calculate("-2 ** 3") == -8
    for bad in ("__import__('os')", "2 ** 1000", "a + 1"):
        with pytest.raises(ValueError):
            calculate(bad)
    env = ToolUseEnv()
    assert is_multi_turn(env)
    task = env.sample_task(random.Random(3))
    expr = task.info["expression"]
    say = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    assert env.respond(task, say(f"<calc>{expr}</calc>")) == f"<result>{task.answer}</result>"
    assert env.respond(task, say(f"<python>print({expr})</python>")) == f"<result>{task.answer}</result>"
    assert env.respond(task, say("<python>import socket; socket.socket()</python>")).startswith(
        "<result>error: PermissionError: sandbox")
    assert "No tool call" in env.respond(task, say("hmm"))
    assert env.respond(task, say(f"<answer>{task.answer}</answer>")) is None
    assert env.reward(task, say(f"<answer>{task.answer}</answer>")) == 1.0
    assert env.reward(task, say("<answer>1</answer>")) == 0.0 and env.reward(task, say("x")) == 0.0
