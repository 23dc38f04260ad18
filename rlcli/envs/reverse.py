"""Reverse a short string. Verifiable, dense reward: the similarity of the answer to the
reversal (1 - normalized edit distance), so partial credit guides RL."""

import random

from rlcli.config.env import builtin_args
from rlcli.envs import Task


def edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def similarity(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    return 1.0 - edit_distance(a, b) / max(len(a), len(b))


class ReverseEnv:
    def __init__(self, **args):
        self.cfg = builtin_args("reverse", args)

    def sample_task(self, rng: random.Random) -> Task:
        n = rng.randint(self.cfg.min_len, self.cfg.max_len)
        s = "".join(rng.choice(self.cfg.alphabet) for _ in range(n))
        if self.cfg.instruction:
            prompt = f"Reverse the string '{s}'. Reply with the reversed string only."
        else:
            prompt = f"{s}="
        return Task(prompt=prompt, answer=s[::-1], info={"length": n})

    def reward(self, task: Task, completion: str) -> float:
        answer = completion.strip().strip("'\"").strip()
        if self.cfg.reward == "exact":
            return float(answer == task.answer)
        return similarity(answer, task.answer)

    def demonstration(self, task: Task) -> str:
        return task.answer
