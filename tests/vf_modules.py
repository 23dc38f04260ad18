"""Two verifiers plugins for tests and bench/verifiers_http.py: a taskset (``vf_echo``: say a
number; rewards for saying it, for brevity and per model turn) and a multi-turn env
(``vf_feedback``: answers every reply with feedback for ``rounds`` model turns)."""

import textwrap
from pathlib import Path

TASKSET = '''
import verifiers.v1 as vf

__all__ = ["EchoTaskset"]


class EchoData(vf.TaskData):
    answer: str = ""


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def has_answer(self, task, trace) -> float:
        return float(task.answer in (trace.last_reply or ""))

    @vf.reward(weight=0.5)
    async def short(self, task, trace) -> float:
        return float(len(trace.last_reply or "") <= 12)

    @vf.reward(weight=0.25)
    async def turns(self, task, trace) -> float:
        return float(trace.num_turns)


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 4


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield EchoTask(EchoData(prompt=f"say {i}", system_prompt="Be brief.", answer=str(i)), self.config.task)

'''

FEEDBACK_ENV = '''
import verifiers.v1 as vf

__all__ = ["FeedbackEnv"]


class FeedbackConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    rounds: int = 3


class FeedbackEnv(vf.Env[FeedbackConfig]):
    """Multi-turn: after each reply the environment answers with feedback, as a user would."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for r in range(1, self.config.rounds):
                if segment.terminated:
                    break
                segment = await chat.turn(f"try again ({r})")
'''


def write_vf_modules(root: Path) -> None:
    """Write the packages ``vf_echo`` and ``vf_feedback`` under ``root`` (put it on sys.path)."""
    for name, source in (("vf_echo", TASKSET), ("vf_feedback", FEEDBACK_ENV)):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(textwrap.dedent(source))
