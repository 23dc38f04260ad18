"""Tool use, multi-turn: arithmetic the model may solve with a calculator or Python.

The model writes ``<calc>expression</calc>`` (evaluated by :func:`calculate`, a small
arithmetic evaluator over Python's AST, no ``eval``) or ``<python>code</python>`` (run by
:func:`rlcli.envs.sandbox.run_python` with CPU, memory and wall-clock limits and no
network); the environment answers ``<result>...</result>`` and the model continues. The
episode ends at ``<answer>N</answer>``, or when the model calls no tool and
``env.args.nudge`` is off (with it on, the environment reminds the model of the format
until ``env.max_turns``). Reward: 1 when the last answer equals the true value, else 0.
"""

import ast
import operator
import random
import re

from rlcli.config.env import builtin_args
from rlcli.envs import Task

_CALL = re.compile(r"<(calc|python)>(.*?)</\1>", re.S)
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}

INSTRUCTIONS = ("Tools: <calc>expression</calc> evaluates arithmetic; <python>code</python> runs Python and "
                "returns what it prints. Each result comes back as <result>...</result>. "
                "Finish with <answer>number</answer>.")

NUDGE = "No tool call or answer found: use <calc>...</calc>, <python>...</python> or <answer>...</answer>."


def calculate(expression: str) -> int | float:
    """Value of an arithmetic expression: numbers, + - * / // % **, parentheses."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported expression: {ast.dump(node)[:40]}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return ev(ast.parse(expression.strip(), mode="eval"))


def last_answer(messages: list[dict[str, str]]) -> str | None:
    for m in reversed(messages):
        if m["role"] == "assistant" and (found := _ANSWER.findall(m["content"])):
            return found[-1]
    return None


class ToolUseEnv:
    def __init__(self, **args):
        self.cfg = builtin_args("tool-use", args)

    def sample_task(self, rng: random.Random) -> Task:
        c = self.cfg
        digits = [rng.randint(c.min_digits, c.max_digits) for _ in range(3)]
        a, b, d = (rng.randint(10 ** (n - 1), 10 ** n - 1) for n in digits)
        op1, op2 = rng.choice("+-*"), rng.choice("+-")
        expression = f"{a} {op1} {b} {op2} {d}"
        return Task(prompt=f"What is {expression}? {INSTRUCTIONS}", answer=calculate(expression),
                    info={"expression": expression})

    def respond(self, task: Task, messages: list[dict[str, str]]) -> str | None:
        text = messages[-1]["content"]
        calls = _CALL.findall(text)
        if not calls:
            if _ANSWER.search(text) or not self.cfg.nudge:
                return None
            return NUDGE
        kind, body = calls[0]
        return f"<result>{self.run_tool(kind, body)[:self.cfg.max_output_chars]}</result>"

    def run_tool(self, kind: str, body: str) -> str:
        if kind == "calc":
            try:
                return str(calculate(body))
            except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError) as e:
                return f"error: {e}"
        from rlcli.envs.sandbox import run_python

        c = self.cfg
        r = run_python(body, cpu_s=c.python_cpu_s, memory_mb=c.python_memory_mb, timeout_s=c.python_timeout_s,
                       max_output_chars=c.max_output_chars)
        if r.timed_out:
            return "error: timed out"
        if r.returncode != 0:
            return "error: " + (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        return r.stdout.strip()

    def reward(self, task: Task, messages: list[dict[str, str]]) -> float:
        answer = last_answer(messages)
        if answer is None:
            return 0.0
        try:
            return float(abs(float(answer.replace(",", "")) - task.answer) < 1e-9)
        except ValueError:
            return 0.0

    def demonstration(self, task: Task) -> str:
        return f"<calc>{task.info['expression']}</calc>"
