"""A throughput workload with long-tailed completion lengths (log-normal), EOS ignored.

Real reasoning workloads have a few completions far longer than the median; under
synchronous RL the whole step waits for them. The reward is a cheap function of the
text so the loop runs end to end; what matters here is timing (bench/async_vs_sync.py).
"""

import math
import random

from rlcli.config.env import builtin_args
from rlcli.envs import Task


class LongTailEnv:
    def __init__(self, **args):
        self.cfg = builtin_args("longtail", args)

    def sample_task(self, rng: random.Random) -> Task:
        c = self.cfg
        prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(c.prompt_len))
        length = int(round(c.median_tokens * math.exp(rng.gauss(0.0, c.sigma))))
        return Task(prompt=prompt, answer=None, max_tokens=max(1, min(length, c.max_tokens)), ignore_eos=True,
                    info={"target_tokens": length})

    def reward(self, task: Task, completion: str) -> float:
        if not completion:
            return 0.0
        return sum(ch in "aeiou" for ch in completion) / len(completion)

    def demonstration(self, task: Task) -> str:
        return "a" * (task.max_tokens or 1)
