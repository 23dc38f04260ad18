"""verifiers (0.4.0, prime-rl's environment format) tasksets as single-turn environments
(``pip install 'rlcli[verifiers]'``).

A verifiers environment is a *taskset* (an installed package exporting a ``Taskset``
subclass through ``__all__``; its ``load()`` yields tasks) whose tasks carry their scoring:
``@vf.reward`` methods (weighted) and judges. verifiers runs episodes itself, through an
agent harness that calls an OpenAI-compatible endpoint; this adapter instead lets rlcli's
loop generate and uses the taskset for data and scoring only:

- ``sample_task`` draws one of the taskset's tasks (``env.args.size`` of them at most, read
  once); the prompt is the task's ``system_prompt`` and ``prompt_text``;
- ``reward`` builds a verifiers ``Trace`` holding the prompt and the completion as the one
  sampled assistant message and awaits the task's own ``score(trace)``; the reward is
  ``trace.reward``, the weighted sum verifiers reports. Reward functions that need a
  runtime (a sandbox box) are skipped by verifiers itself when none is given, as in its
  offline scoring.

Multi-turn verifiers environments (tools, harnesses, user simulators) are not adapted: their
episodes are driven by verifiers' harness, which would talk to rl-infer's OpenAI API
(``rl-infer --http-port``) rather than to this loop.

    [env]
    name = "verifiers"
    args = { taskset = "my-taskset", config = { ... }, size = 1000 }
"""

import random
from typing import Any

from rlcli.envs import Task
from rlcli.errors import ConfigError


class VerifiersEnv:
    def __init__(self, taskset: str, config: dict[str, Any] | None = None, size: int = 10000):
        try:
            from verifiers.v1.utils.loaders import load_taskset, taskset_config_type
        except ImportError:
            raise ConfigError("env verifiers: verifiers is not installed; pip install 'rlcli[verifiers]'") from None
        try:
            ts_config = taskset_config_type(taskset)(id=taskset, **(config or {}))
            loaded = load_taskset(ts_config)
            self.tasks = []
            for task in loaded:
                self.tasks.append(task)
                if len(self.tasks) >= size:
                    break
        except Exception as e:  # an unknown taskset or a bad option, in verifiers' own words
            raise ConfigError(f"env verifiers: env.args.taskset={taskset!r}: {type(e).__name__}: {e}") from None
        if not self.tasks:
            raise ConfigError(f"env verifiers: taskset {taskset!r} yielded no tasks")
        self.name = taskset

    def sample_task(self, rng: random.Random) -> Task:
        index = rng.randrange(len(self.tasks))
        data = self.tasks[index].data
        prompt = data.prompt_text
        if data.system_prompt:
            prompt = f"{data.system_prompt}\n\n{prompt}"
        return Task(prompt=prompt, answer=getattr(data, "answer", None),
                    info={"taskset": self.name, "index": index, "id": data.id})

    def trace(self, task: Task, completion: str):
        """A verifiers Trace of one turn: the task's prompt, then ``completion`` as the sampled reply."""
        import verifiers.v1 as vf
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask
        from verifiers.v1.types import AssistantMessage, SystemMessage, UserMessage

        vtask = self.tasks[task.info["index"]]
        data = vtask.data
        nodes = [MessageNode(message=SystemMessage(content=data.system_prompt))] if data.system_prompt else []
        nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=UserMessage(content=data.prompt_text)))
        nodes.append(MessageNode(parent=len(nodes) - 1, message=AssistantMessage(content=completion), sampled=True))
        return Trace(task=TraceTask(type=type(vtask).__name__, data=data, key=vtask.key, hash=vtask.hash),
                     agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes, is_completed=True, ok=True)

    async def reward(self, task: Task, completion: str) -> float:
        trace = self.trace(task, completion)
        await self.tasks[task.info["index"]].score(trace)
        return float(trace.reward)
