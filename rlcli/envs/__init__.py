"""Environments: tasks, rewards, tool turns and (for SFT warm-up) demonstrations.

Shared by rl-orchestrate (sampling tasks, running episodes, scoring them) and rl-train
(supervised warm-up on demonstrations), so it lives beside ``models`` rather than inside
either process package.

The interface is duck-typed; an environment is any object with

- ``sample_task(rng) -> Task``, and
- ``reward(task, completion) -> float``: for a *single-turn* environment ``completion`` is the
  model's text (prompt -> completion -> reward);
- optionally ``respond(task, messages) -> str | dict | None``, which makes it *multi-turn*:
  after every model turn the loop calls it with the episode's messages so far (after the
  prompt: ``{"role": "assistant", "content": ...}`` for the model's turns, the environment's
  own turns as it returned them). A string (or a ``{"role", "content"}`` dict; role defaults
  to ``user``) is the environment's turn, appended to the sequence as context only: the loss
  never trains on it. ``None`` ends the episode, which is then scored with
  ``reward(task, messages)``.
- optionally ``demonstration(task) -> str`` for ``rl-train sft``.
- optionally ``num_tasks`` (an int) and ``task(index) -> Task`` for ``index`` in
  ``range(num_tasks)``: a *dataset* environment, which rl-orchestrate draws from in epochs
  (``env.order``, :class:`EpochOrder`).

``reward`` and ``respond`` may be ``async def``. They run on worker threads off the dispatch
loop (:mod:`rlcli.envs.runner`), with a timeout; one that raises, returns a non-number or
runs too long is logged with the environment's name and scored ``env.on_error``.

:func:`make_env` resolves ``env.name`` (:mod:`rlcli.envs.registry`): a built-in, an entry
point in the group ``rlcli.envs``, or ``package.module:factory``, called with ``env.args``.
"""

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlcli.config.env import EnvConfig


@dataclass
class Task:
    prompt: str
    """What the model is asked (plain text; the chat template is applied by render_prompt)."""
    answer: Any = None
    """What the reward compares against."""
    max_tokens: int | None = None
    """Completion budget of each model turn (None: the recipe's sampling.max_tokens)."""
    ignore_eos: bool = False
    """Generate exactly max_tokens tokens."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything else worth logging."""
    max_episode_tokens: int | None = None
    """Token budget of the whole episode, prompt included (None: env.max_episode_tokens)."""
    timeout_s: float | None = None
    """Wall-clock budget of a multi-turn episode (None: env.episode_timeout_s)."""


class Environment(Protocol):
    def sample_task(self, rng: random.Random) -> Task: ...

    def reward(self, task: Task, completion: Any) -> float: ...


class MultiTurnEnvironment(Environment, Protocol):
    def respond(self, task: Task, messages: list[dict[str, str]]) -> str | dict | None: ...


def is_multi_turn(env: Any) -> bool:
    return callable(getattr(env, "respond", None))


def is_dataset(env: Any) -> bool:
    return callable(getattr(env, "task", None)) and isinstance(getattr(env, "num_tasks", None), int)


class EpochOrder:
    """Task indices of a dataset of ``num_tasks``: each once per epoch, the order of epoch e a
    permutation shuffled from ``seed`` and e. ``position`` (indices drawn so far) is all its
    state, so an order rebuilt at a saved position goes on exactly as the original would have."""

    def __init__(self, num_tasks: int, seed: int, position: int = 0):
        if num_tasks < 1:
            raise ValueError(f"a dataset environment needs num_tasks >= 1, got {num_tasks}")
        self.num_tasks, self.seed, self.position = num_tasks, seed, position
        self._epoch, self._order = -1, []

    @property
    def epoch(self) -> float:
        """Epochs drawn, fractional."""
        return self.position / self.num_tasks

    def next(self) -> int:
        epoch, i = divmod(self.position, self.num_tasks)
        if epoch != self._epoch:
            self._order = list(range(self.num_tasks))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        self.position += 1
        return self._order[i]


def make_env(cfg: EnvConfig) -> Environment:
    from rlcli.envs.registry import load_env

    args = dict(cfg.args)
    if cfg.name == "reverse":  # its prompt phrasing follows the chat template unless set
        args.setdefault("instruction", cfg.use_chat_template)
    return load_env(cfg.name, args)


def render_prompt(task: Task, tokenizer, cfg: EnvConfig) -> list[int]:
    """Prompt token ids, through the chat template when the recipe asks for it."""
    if cfg.use_chat_template:
        messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else [])
        messages.append({"role": "user", "content": task.prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(task.prompt)
