"""Several environments as one (``env.name = "mix"``): each task is drawn from one of them by weight.

    [env]
    name = "mix"
    args.envs = [{name = "math", weight = 3, args = {verifier = "numeric"}}, {name = "reverse"}]

Each member is built as ``env.name`` builds one (a built-in, an entry point, ``package.module:factory``,
with its own ``args``). ``sample_task`` picks a member with probability ``weight / sum(weights)`` from
the loop's generator, lets it draw the task, and tags the task with the member's label
(``task.info["env"]``); ``reward``, ``respond`` and ``demonstration`` go to the member the tag names,
so a task is always scored by the environment that made it, also in ``rl-orchestrate score``, whose
records carry ``info``. The mixture is multi-turn when any member is: a single-turn member's episode
then ends after its first model turn (``respond`` returns None) and its reward gets that turn's text,
as it would alone. rl-orchestrate reports each member's mean reward (``reward_mean/<label>``) beside
the total, and so does an evaluation (orchestrate.eval). Members that run their own episodes over
HTTP (``verifiers`` with ``use_http``) cannot be mixed. Rendering settings (chat template, system
prompt) and the loop's budgets are the ``[env]`` table's, shared by all members.
"""

import bisect
import itertools
import random
from typing import Any

from rlcli.config.env import builtin_args
from rlcli.envs import Task, is_multi_turn
from rlcli.errors import ConfigError

LABEL = "env"
"""The key of ``task.info`` that names the member a task came from."""


class MixEnv:
    def __init__(self, **args):
        from rlcli.envs.registry import load_env

        self.cfg = builtin_args("mix", args)
        self.members: dict[str, Any] = {}
        for m in self.cfg.envs:
            label = m.label or m.name
            env = load_env(m.name, dict(m.args))
            if callable(getattr(env, "run_group", None)):
                raise ConfigError(f"env mix: {label} runs its own episodes over HTTP and cannot be mixed")
            self.members[label] = env
        self.labels = list(self.members)
        self.bounds = list(itertools.accumulate(m.weight for m in self.cfg.envs))
        self.multi_turn = {label: is_multi_turn(env) for label, env in self.members.items()}
        if any(self.multi_turn.values()):
            self.respond = self._respond  # the loop sees a multi-turn environment only if a member is one
        if all(callable(getattr(env, "demonstration", None)) for env in self.members.values()):
            self.demonstration = self._demonstration

    def _member(self, task: Task) -> tuple[str, Any]:
        label = (task.info or {}).get(LABEL)
        if label not in self.members:
            raise ValueError(f"task.info[{LABEL!r}] is {label!r}, not one of the mixture's environments "
                             f"({', '.join(self.labels)})")
        return label, self.members[label]

    def sample_task(self, rng: random.Random) -> Task:
        i = min(bisect.bisect_right(self.bounds, rng.random() * self.bounds[-1]), len(self.labels) - 1)
        label = self.labels[i]
        task = self.members[label].sample_task(rng)
        task.info = {**(task.info or {}), LABEL: label}
        return task

    def reward(self, task: Task, completion: Any) -> Any:
        label, env = self._member(task)
        if isinstance(completion, list) and not self.multi_turn[label]:  # the mixture's episode, one turn
            completion = next((m["content"] for m in reversed(completion) if m.get("role") == "assistant"), "")
        return env.reward(task, completion)

    def _respond(self, task: Task, messages: list[dict[str, str]]) -> Any:
        label, env = self._member(task)
        return env.respond(task, messages) if self.multi_turn[label] else None

    def _demonstration(self, task: Task) -> str:
        return self._member(task)[1].demonstration(task)


def per_env(tasks_and_rewards, prefix: str = "reward_mean") -> dict[str, float]:
    """``{prefix}/<label>``: the mean reward of each mixed environment's tasks, for tasks tagged
    ``info["env"]`` (``(task, rewards)`` pairs; {} when no task is tagged)."""
    sums: dict[str, list[float]] = {}
    for task, rewards in tasks_and_rewards:
        label = (task.info or {}).get(LABEL)
        if label is not None and rewards:
            sums.setdefault(label, []).extend(rewards)
    return {f"{prefix}/{label}": sum(r) / len(r) for label, r in sorted(sums.items())}
