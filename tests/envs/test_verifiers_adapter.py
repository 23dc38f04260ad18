"""The verifiers adapter: a verifiers taskset (an installed package exporting a Taskset through
__all__) runs as a single-turn environment; rewards equal verifiers' own scoring."""

import asyncio
import random
import textwrap

import pytest

from rlcli.config import load_recipe
from rlcli.envs import is_dataset, make_env

pytest.importorskip("verifiers.v1", reason="verifiers is the `verifiers` extra")

TASKSET = '''
import verifiers.v1 as vf

__all__ = ["AddTaskset"]


class AddData(vf.TaskData):
    answer: str = ""


class AddTask(vf.Task[AddData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.split()[-1:] == [task.answer]) if trace.last_reply else 0.0

    @vf.reward(weight=0.25)
    async def brief(self, task, trace) -> float:
        return float(len(trace.last_reply) <= 8)


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 20


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield AddTask(AddData(prompt=f"What is {i} + {2 * i}?", system_prompt="Answer with a number.",
                                  answer=str(3 * i)), self.config.task)
'''


@pytest.fixture
def taskset(tmp_path, monkeypatch):
    (tmp_path / "rlcli_vf_add").mkdir()
    (tmp_path / "rlcli_vf_add" / "__init__.py").write_text(textwrap.dedent(TASKSET))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "rlcli_vf_add"


def test_rewards_match_verifiers_scoring(taskset):
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, UserMessage
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    cfg = load_recipe(None, {}, {"env.name": "verifiers", "env.args": {"taskset": taskset, "config": {"num_tasks": 7}}})
    env = make_env(cfg.env)
    reference = {t.data.prompt: t for t in load_taskset(taskset_config_type(taskset)(id=taskset, num_tasks=7))}
    rng = random.Random(0)
    seen = set()
    for _ in range(10):
        task = env.sample_task(rng)
        assert task.prompt.startswith("Answer with a number.\n\n")
        vtask = reference[task.prompt.split("\n\n", 1)[1]]
        for completion in (vtask.data.answer, f"The sum is {vtask.data.answer}", "It is surely 99999", ""):
            trace = Trace(task=TraceTask(type="AddTask", data=vtask.data), agent=AgentInfo(config=vf.AgentConfig()),
                          nodes=[MessageNode(message=UserMessage(content=vtask.data.prompt)),
                                 MessageNode(parent=0, message=AssistantMessage(content=completion), sampled=True)])
            asyncio.run(vtask.score(trace))
            got = asyncio.run(env.reward(task, completion))
            assert got == pytest.approx(trace.reward)
            # The rubric by hand: a wrong prompt, answer or reply in the adapter's trace changes this.
            words = completion.split()
            assert got == pytest.approx(float(words[-1:] == [str(3 * int(task.prompt.split()[-3]))])
                                        + 0.25 * float(len(completion) <= 8))
            seen.add(got)
    assert seen >= {1.25, 1.0, 0.25, 0.0}  # every mix of the two weighted rewards came up
    # A dataset environment (drawn in epochs by rl-orchestrate): task(i) is the taskset's i-th task.
    assert is_dataset(env) and env.num_tasks == 7
    assert sorted(env.task(i).prompt.split("\n\n", 1)[1] for i in range(7)) == sorted(reference)


def test_unknown_taskset_is_a_config_error():
    from rlcli.errors import ConfigError

    cfg = load_recipe(None, {}, {"env.name": "verifiers", "env.args": {"taskset": "no-such-taskset"}})
    with pytest.raises(ConfigError, match="env.args.taskset='no-such-taskset'"):
        make_env(cfg.env)
