"""Math with answer checking: generated problems, the answer in ``\\boxed{}``.

Problems are drawn from a seeded generator (integer arithmetic, sums of fractions, one
linear equation), so no dataset is downloaded and the true answer is exact. The check is
``math-verify`` (``pip install 'rlcli[math]'``): it extracts the last boxed or final
expression of the completion, parses LaTeX or plain math, and compares symbolically, so
``\\frac{3}{4}``, ``0.75`` and ``3/4`` all match. Its own signal-based timeout only works
in a main thread, so it is switched off here; the loop's ``env.reward_timeout_s`` bounds
each call instead. ``verifier = "numeric"`` needs no extra: the last number (or ``p/q``)
of the completion compared as a rational.
"""

import random
import re
from fractions import Fraction

from rlcli.config.env import builtin_args
from rlcli.envs import Task
from rlcli.errors import ConfigError

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:\s*/\s*-?\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def math_verify_score(gold: str, completion: str) -> float:
    """1.0 when math-verify finds ``completion``'s answer equal to ``gold`` (LaTeX or plain), else 0.0."""
    from math_verify import parse, verify

    target = parse(f"${gold}$", parsing_timeout=None)
    answer = parse(completion, parsing_timeout=None)
    return float(bool(answer) and verify(target, answer, timeout_seconds=None))


def numeric_score(gold: str, completion: str) -> float:
    boxed = _BOXED.findall(completion)
    text = boxed[-1] if boxed else completion
    text = re.sub(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", r"\1/\2", text)
    numbers = _NUMBER.findall(text)
    if not numbers:
        return 0.0
    try:
        return float(Fraction(numbers[-1].replace(" ", "")) == Fraction(gold))
    except (ValueError, ZeroDivisionError):
        return 0.0


class MathEnv:
    def __init__(self, **args):
        self.cfg = builtin_args("math", args)
        if self.cfg.verifier == "math-verify":
            try:
                import math_verify  # noqa: F401
            except ImportError:
                raise ConfigError("env math: math-verify is not installed; pip install 'rlcli[math]' or set "
                                  "env.args.verifier = \"numeric\"") from None
        self.score = math_verify_score if self.cfg.verifier == "math-verify" else numeric_score

    def sample_task(self, rng: random.Random) -> Task:
        lo, hi = self.cfg.min_value, self.cfg.max_value
        kind = rng.choice(self.cfg.kinds)
        if kind == "arithmetic":
            a, b, c = (rng.randint(lo, hi) for _ in range(3))
            question, answer = f"Compute {a} * {b} - {c}.", str(a * b - c)
        elif kind == "fraction":
            a, b, c, d = (rng.randint(lo, hi) for _ in range(4))
            value = Fraction(a, b) + Fraction(c, d)
            question, answer = f"Compute {a}/{b} + {c}/{d} as a reduced fraction.", str(value)
        else:
            a, x, b = rng.randint(lo, hi), rng.randint(-hi, hi), rng.randint(lo, hi)
            question, answer = f"Solve for x: {a}x + {b} = {a * x + b}.", str(x)
        prompt = f"{question} Put the final answer in \\boxed{{}}."
        latex = answer if "/" not in answer else "\\frac{%s}{%s}" % tuple(answer.split("/"))
        return Task(prompt=prompt, answer=latex, info={"kind": kind, "value": answer})

    def reward(self, task: Task, completion: str) -> float:
        return self.score(task.answer if self.cfg.verifier == "math-verify" else task.info["value"], completion)

    def demonstration(self, task: Task) -> str:
        return f"\\boxed{{{task.answer}}}"
