"""reasoning-gym tasks as an environment (``pip install 'rlcli[reasoning-gym]'``).

reasoning-gym generates procedural tasks (arithmetic, puzzles, logic, ...) from a seed, so
nothing is downloaded. A task is entry ``i`` of ``reasoning_gym.create_dataset(name,
size=..., seed=..., **config)``; the reward is the library's own
``dataset.score_answer(answer, entry)`` on the completion's last ``<answer>...</answer>``
(``reasoning_gym.utils.extract_answer``), exactly as reasoning-gym scores it. The prompt
is the library's default system prompt followed by the question, unless
``env.args.system_prompt = false`` (then use ``env.system_prompt`` with the chat template).

    [env]
    name = "reasoning-gym"
    use_chat_template = true
    args = { dataset = "basic_arithmetic", size = 10000, seed = 0, config = { min_terms = 2, max_terms = 3 } }
"""

import random
from typing import Any

from rlcli.envs import Task
from rlcli.errors import ConfigError


def _import():
    try:
        import reasoning_gym
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer
    except ImportError:
        raise ConfigError("env reasoning-gym: reasoning-gym is not installed; pip install 'rlcli[reasoning-gym]'") \
            from None
    return reasoning_gym, SYSTEM_PROMPTS, extract_answer


class ReasoningGymEnv:
    def __init__(self, dataset: str = "basic_arithmetic", size: int = 10000, seed: int = 0,
                 config: dict[str, Any] | None = None, system_prompt: bool = True):
        rg, prompts, self.extract_answer = _import()
        try:
            self.dataset = rg.create_dataset(dataset, size=size, seed=seed, **(config or {}))
        except Exception as e:  # an unknown name or a bad option, in reasoning-gym's own words
            raise ConfigError(f"env reasoning-gym: env.args.dataset={dataset!r} with env.args.config={config!r}: "
                              f"{type(e).__name__}: {e}") from None
        self.name, self.size = dataset, size
        self.system = prompts["default"] if system_prompt else ""

    def entry(self, index: int) -> dict[str, Any]:
        return self.dataset[index]

    @property
    def num_tasks(self) -> int:
        return self.size

    def sample_task(self, rng: random.Random) -> Task:
        return self.task(rng.randrange(self.size))

    def task(self, index: int) -> Task:
        entry = self.entry(index)
        prompt = f"{self.system}\n{entry['question']}" if self.system else entry["question"]
        return Task(prompt=prompt, answer=entry["answer"], info={"dataset": self.name, "index": index})

    def reward(self, task: Task, completion: str) -> float:
        entry = self.entry(task.info["index"])
        return float(self.dataset.score_answer(answer=self.extract_answer(completion), entry=entry))

    def demonstration(self, task: Task) -> str:
        return f"<answer>{task.answer}</answer>"
