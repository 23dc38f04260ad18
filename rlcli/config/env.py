"""Environment config: ``env.name`` picks an environment, ``env.args`` is handed to it.

``env.name`` is a built-in (``reverse``, ``longtail``, ``math``, ``tool-use``), the name of an
entry point in the group ``rlcli.envs``, or ``package.module:factory``; ``env.args`` are the
factory's keyword arguments, free-form here and checked by the environment itself (the
built-ins check theirs against the structs below). The other keys are the loop's: chat
rendering, how rewards run off the dispatch loop, and each episode's budgets.

Before environments could be brought in, a built-in's options sat directly in ``[env]``
(``env.min_len``); :func:`migrate_env_table` moves such keys into ``env.args`` so old recipes
and overrides keep working, and names ``env.args.<key>`` for any key that fits nowhere.
"""

import math
from typing import Any, Literal, Optional

import msgspec

from rlcli.config.base import Config


BUILTINS = {
    "reverse": "rlcli.envs.reverse:ReverseEnv",
    "longtail": "rlcli.envs.longtail:LongTailEnv",
    "math": "rlcli.envs.math:MathEnv",
    "tool-use": "rlcli.envs.tools:ToolUseEnv",
    "reasoning-gym": "rlcli.envs.reasoning_gym:ReasoningGymEnv",
    "verifiers": "rlcli.envs.verifiers_adapter:VerifiersEnv",
    "mix": "rlcli.envs.mix:MixEnv",
}
"""Built-in environments: name -> module:factory, resolved like a user's package.module:factory."""

ENTRY_POINT_GROUP = "rlcli.envs"
"""Entry-point group in which installed packages register environments."""


def entry_point(name: str) -> str | None:
    """``module:factory`` of the entry point ``name`` in the group rlcli.envs, if one is installed."""
    from importlib.metadata import entry_points

    return next((ep.value for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name), None)


class EnvConfig(Config):
    """The environment: tasks, rewards, tool turns, and how the loop runs them."""

    name: str = "reverse"
    """A built-in (reverse, longtail, math, tool-use), an entry point in the group rlcli.envs, or
    package.module:factory (a callable taking env.args as keyword arguments)."""

    args: dict[str, Any] = {}
    """Keyword arguments of the environment's factory (free-form; the environment checks them)."""

    order: Literal["epochs", "sample"] = "epochs"
    """How rl-orchestrate draws tasks from a dataset environment (one with ``num_tasks`` and
    ``task(index)``). epochs: every task once per epoch, in an order shuffled per epoch from the
    recipe's seed; a restarted rl-orchestrate goes on where its last batch left off
    (RUN/progress/orchestrate.json). sample: ``sample_task(rng)``, with replacement. Other
    environments always sample."""

    use_chat_template: bool = False
    """Render each prompt (and each environment turn) through the tokenizer's chat template."""

    system_prompt: str = ""
    """System message placed before the prompt when use_chat_template is set."""

    num_workers: int = 4
    """Reward and environment-turn calls run on this many worker threads, off the dispatch
    loop; 0 scores inline in the loop (a slow reward then stalls dispatch)."""

    executor: Literal["threads", "processes"] = "threads"
    """What runs those calls. threads: the orchestrator's own (an environment need not be
    picklable; a pure-Python CPU-bound reward holds the GIL against the dispatch loop and the other
    calls). processes: num_workers worker processes, each building its own copy of the environment
    from this table, so CPU-bound rewards run in parallel, and one past its deadline is killed.
    Calls and results are pickled, and no call may rely on state another call left in the
    environment object."""

    reward_timeout_s: float = 60.0
    """A reward or environment turn that takes longer is scored env.on_error (its thread is
    abandoned, not waited for; its worker process is killed). Only with num_workers > 0."""

    on_error: float = 0.0
    """Reward of an episode whose environment raised, returned a non-number or ran past a budget."""

    retries: int = 0
    """Run a reward or environment turn that failed (raised, returned the wrong type, ran past
    env.reward_timeout_s) again, up to this many more times, before its episode counts as failed
    (env.on_error, env.errors). For failures of the infrastructure (a sandbox, a judge's connection);
    a deterministic failure only costs the attempts. Episodes of the loop and of rl-orchestrate
    score; an environment that runs its own episodes over HTTP retries as it does."""

    errors: Literal["reward", "mask"] = "reward"
    """What such an episode trains. reward: it is scored env.on_error and trained like any other, so
    the model learns to avoid what failed. mask: it trains nothing (its loss is masked) and its reward
    is left out of its group's baseline, as when the failure is the infrastructure's (a sandbox that
    timed out, a lost connection) and says nothing of the completion; prime-rl drops such rollouts."""

    max_turns: int = 8
    """Most model turns per multi-turn episode (single-turn environments have one)."""

    max_episode_tokens: int = 0
    """Most tokens per episode, prompt, model and environment turns together (a task may ask
    for fewer); 0 means model.max_seq_len."""

    episode_timeout_s: float = 0.0
    """Wall-clock budget of a multi-turn episode, from its first model turn's reply; an
    environment turn that comes later ends the episode, scored env.on_error. 0: no limit."""

    truncation: Literal["reward", "on_error", "mask"] = "reward"
    """An episode cut by its token budget is scored by the environment as it stands (reward),
    given env.on_error, or kept with its loss masked so it trains nothing (mask, DAPO's
    overlong filtering)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("env.name must name an environment (reverse, math, tool-use, package.module:factory)")
        if ":" not in self.name and self.name not in BUILTINS and entry_point(self.name) is None:
            raise ValueError(f"unknown env.name {self.name!r}: use a built-in ({', '.join(BUILTINS)}), an entry "
                             f"point in the group {ENTRY_POINT_GROUP}, or package.module:factory")
        if self.num_workers < 0:
            raise ValueError(f"env.num_workers must be >= 0, got {self.num_workers}")
        if self.executor == "processes" and self.num_workers < 1:
            raise ValueError("env.executor = \"processes\" needs env.num_workers >= 1")
        if self.reward_timeout_s <= 0:
            raise ValueError(f"env.reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        if self.retries < 0:
            raise ValueError(f"env.retries must be >= 0, got {self.retries}")
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens < 0 or self.episode_timeout_s < 0:
            raise ValueError("env.max_episode_tokens and env.episode_timeout_s must be >= 0 (0: no extra limit)")


# ---------------------------------------------------------------- built-ins' env.args


class ReverseEnvConfig(Config):
    """env.args of `reverse`: reverse a short string; reward is the similarity of the answer."""

    min_len: int = 3
    """Shortest string to reverse, in characters."""

    max_len: int = 8
    """Longest string to reverse, in characters."""

    alphabet: str = "abcdefghijklmnopqrstuvwxyz"
    """Characters the strings are drawn from."""

    reward: Literal["similarity", "exact"] = "similarity"
    """similarity: 1 - normalized edit distance, in [0, 1]; exact: 1 if exactly right else 0."""

    instruction: Optional[bool] = None
    """Ask in words ("Reverse the string 'abc'. ...") instead of "abc="; None: when
    env.use_chat_template is set."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"env.args.min_len ({self.min_len}) must be >= 1 and <= env.args.max_len ({self.max_len})"
            )
        if not self.alphabet:
            raise ValueError("env.args.alphabet must not be empty")


class LongTailEnvConfig(Config):
    """env.args of `longtail`: each task asks for a completion whose length is drawn from a
    long-tailed (log-normal) distribution, generated with EOS ignored. Reward is a cheap
    function of the tokens. Used by bench/async_vs_sync.py."""

    prompt_len: int = 16
    """Prompt length in characters."""

    median_tokens: int = 24
    """Median completion length in tokens."""

    sigma: float = 1.0
    """Log-normal shape: larger means a longer tail."""

    max_tokens: int = 512
    """Completion lengths are clipped to this many tokens."""

    def __post_init__(self) -> None:
        if self.median_tokens < 1 or self.max_tokens < self.median_tokens:
            raise ValueError("env.args.median_tokens must be >= 1 and <= env.args.max_tokens")
        if self.sigma < 0:
            raise ValueError(f"env.args.sigma must be >= 0, got {self.sigma}")


class MathEnvConfig(Config):
    """env.args of `math`: generated arithmetic and linear-equation problems, the answer in
    \\boxed{}, checked by math-verify (the `math` extra) or numerically."""

    min_value: int = 2
    """Smallest operand."""

    max_value: int = 99
    """Largest operand."""

    kinds: list[Literal["arithmetic", "fraction", "linear"]] = msgspec.field(
        default_factory=lambda: ["arithmetic", "fraction", "linear"])
    """Problem kinds drawn uniformly: integer arithmetic, sums of fractions, one linear equation."""

    verifier: Literal["math-verify", "numeric"] = "math-verify"
    """math-verify parses LaTeX and expressions (pip install 'rlcli[math]'); numeric compares the
    last number of the answer as a rational."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_value <= self.max_value:
            raise ValueError("env.args.min_value must be >= 1 and <= env.args.max_value")
        if not self.kinds:
            raise ValueError("env.args.kinds must name at least one problem kind")


class ToolUseEnvConfig(Config):
    """env.args of `tool-use`: arithmetic the model solves with a calculator and a sandboxed
    Python executor, over several turns; reward 1 for the right final answer."""

    min_digits: int = 3
    """Fewest digits of each operand."""

    max_digits: int = 5
    """Most digits of each operand."""

    python_cpu_s: int = 2
    """CPU-seconds limit of one sandboxed Python run (RLIMIT_CPU)."""

    python_memory_mb: int = 256
    """Address-space limit of one sandboxed Python run (RLIMIT_AS)."""

    python_timeout_s: float = 5.0
    """Wall-clock limit of one sandboxed Python run."""

    max_output_chars: int = 256
    """A tool's reply is cut to this many characters."""

    nudge: bool = True
    """When the model neither calls a tool nor answers, remind it of the format (another turn)
    instead of ending the episode."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError("env.args.min_digits must be >= 1 and <= env.args.max_digits")
        if self.python_cpu_s < 1 or self.python_memory_mb < 32 or self.python_timeout_s <= 0:
            raise ValueError("env.args.python_cpu_s must be >= 1, python_memory_mb >= 32, python_timeout_s > 0")


class MixMemberConfig(Config):
    """One environment of a mixture (``env.args.envs`` of ``mix``)."""

    name: str
    """The environment, named as env.name names one (a built-in, an entry point, package.module:factory)."""

    args: dict[str, Any] = {}
    """Its factory's keyword arguments."""

    weight: float = 1.0
    """Its share of the tasks drawn: weight / the sum of the weights."""

    label: str = ""
    """How its tasks are tagged (task.info["env"]) and its metrics named; default: name. Unique."""

    def __post_init__(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"a mixed environment's weight must be > 0 and finite, got {self.weight}")


class MixEnvConfig(Config):
    """env.args of `mix`: several environments, each task drawn from one of them by weight and scored
    (and answered, over turns) by the one that drew it."""

    envs: list[MixMemberConfig] = []
    """The environments, e.g. [{name = "math", weight = 3}, {name = "reverse", args = {min_len = 4}}]."""

    def __post_init__(self) -> None:
        if not self.envs:
            raise ValueError("env.args.envs must list at least one environment ({name, args, weight})")
        labels = [m.label or m.name for m in self.envs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"env.args.envs: labels must be unique (give each of a repeated name a label), got "
                             f"{labels}")
        if any(m.name == "mix" for m in self.envs):
            raise ValueError("env.args.envs: a mixture cannot hold another mix; list its environments instead")


BUILTIN_ARGS: dict[str, type[Config]] = {
    "reverse": ReverseEnvConfig, "longtail": LongTailEnvConfig, "math": MathEnvConfig, "tool-use": ToolUseEnvConfig,
    "mix": MixEnvConfig,
}
"""The env.args struct of each built-in environment."""


def migrate_env_table(env: Any) -> None:
    """Move a built-in's options written directly in ``[env]`` (the layout before env.args) into
    ``env.args``, in place; any other unknown key is an error naming where it belongs."""
    if not isinstance(env, dict):
        return
    from rlcli.errors import ConfigError

    extra = [k for k in env if k not in EnvConfig.__struct_fields__]
    if not extra:
        return
    name = env.get("name", EnvConfig.name)
    fields = BUILTIN_ARGS[name].__struct_fields__ if name in BUILTIN_ARGS else ()
    for key in extra:
        if key not in fields:
            raise ConfigError(f"unknown key 'env.{key}'; an environment's own options go under env.args "
                              f"(env.args.{key})")
    args = env.get("args")
    if args is None:
        args = env["args"] = {}
    elif not isinstance(args, dict):
        return  # msgspec names env.args' type error
    for key in extra:
        args[key] = env.pop(key)  # an override (--env.max_len) beats the recipe's env.args


def builtin_args(name: str, args: dict[str, Any]) -> Any:
    """``args`` checked against built-in ``name``'s struct; errors name ``env.args.<key>``."""
    from rlcli.config.load import describe_validation_error
    from rlcli.errors import ConfigError

    try:
        return msgspec.convert(args, BUILTIN_ARGS[name], strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"env {name}: env.args: {describe_validation_error(str(e))}") from None
