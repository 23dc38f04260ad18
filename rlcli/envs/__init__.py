"""Environments: tasks, rewards and (for SFT warm-up) demonstrations.

Shared by rl-orchestrate (sampling tasks, scoring completions) and rl-train (supervised
warm-up on demonstrations), so it lives beside ``models`` rather than inside either
process package. An environment is a small class; :func:`make_env` picks one by the
recipe's ``env.name``.
"""

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlcli.config.env import EnvConfig, LongTailEnvConfig, ReverseEnvConfig


@dataclass
class Task:
    prompt: str
    """What the model is asked (plain text; the chat template is applied by render_prompt)."""
    answer: Any = None
    """What the reward compares against."""
    max_tokens: int | None = None
    """Completion budget for this task (None: the recipe's sampling.max_tokens)."""
    ignore_eos: bool = False
    """Generate exactly max_tokens tokens."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything else worth logging."""


class Environment(Protocol):
    def sample_task(self, rng: random.Random) -> Task: ...

    def reward(self, task: Task, completion: str) -> float: ...

    def demonstration(self, task: Task) -> str: ...


def make_env(cfg: EnvConfig) -> Environment:
    from rlcli.envs.longtail import LongTailEnv
    from rlcli.envs.reverse import ReverseEnv

    if isinstance(cfg, ReverseEnvConfig):
        return ReverseEnv(cfg)
    if isinstance(cfg, LongTailEnvConfig):
        return LongTailEnv(cfg)
    raise ValueError(f"no environment for env.name {type(cfg).__name__}")


def render_prompt(task: Task, tokenizer, cfg: EnvConfig) -> list[int]:
    """Prompt token ids, through the chat template when the recipe asks for it."""
    if cfg.use_chat_template:
        messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else [])
        messages.append({"role": "user", "content": task.prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(task.prompt)
