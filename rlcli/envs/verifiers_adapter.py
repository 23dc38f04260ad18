"""verifiers (0.4.0, prime-rl's environment format) environments (``pip install 'rlcli[verifiers]'``).

Two ways to run them. When rl-infer serves its HTTP API (``infer.http_port`` >= 0) the
orchestrator hands whole groups to :meth:`VerifiersEnv.run_group`: verifiers runs each
episode itself (its env, agents, harness and rubric; single- and multi-turn) against
rl-infer's ``/inference/v1/generate``, and :mod:`rlcli.envs.verifiers_http` turns the
traces into samples with exact tokens, masks, logprobs and versions. Without the HTTP API
(and in ``rl-orchestrate tasks|score|eval`` pipelines) the taskset's single-turn tasks
are used through their data and rubric only, as follows.

A verifiers environment is a *taskset* (an installed package exporting a ``Taskset``
subclass through ``__all__``; its ``load()`` yields tasks) whose tasks carry their scoring:
``@vf.reward`` methods (weighted) and judges. verifiers runs episodes itself, through an
agent harness that calls an OpenAI-compatible endpoint; this adapter instead lets rlcli's
loop generate and uses the taskset for data and scoring only:

- it is a dataset environment: ``task(index)`` is one of the taskset's ``num_tasks`` tasks
  (``env.args.size`` of them at most, read once), which rl-orchestrate draws in epochs
  (``env.order``); ``sample_task`` draws one at random. The prompt is the task's
  ``system_prompt`` and ``prompt_text``;
- ``reward`` builds a verifiers ``Trace`` holding the prompt and the completion as the one
  sampled assistant message and awaits the task's own ``score(trace)``; the reward is
  ``trace.reward``, the weighted sum verifiers reports. Reward functions that need a
  runtime (a sandbox box) are skipped by verifiers itself when none is given, as in its
  offline scoring.

    [env]
    name = "verifiers"
    args = { taskset = "my-taskset", config = { ... }, size = 1000 }
    # HTTP path only: a verifiers env id (empty: the taskset's own, else single-agent),
    # the env's own settings, per-role agent settings, the harness every role runs unless its
    # settings name one, and the renderers config of verifiers' training client (empty: chosen
    # from the model's name)
    args = { taskset = "...", env_id = "user-sim", env_config = { done_marker = "DONE" },
             agents = { user = { max_turns = 3 } }, harness = "rlcli-host",
             renderer = { name = "qwen3" } }
"""

import asyncio
import concurrent.futures
import threading

import random
from typing import Any

from rlcli.envs import Task
from rlcli.errors import ConfigError


class VerifiersEnv:
    def __init__(self, taskset: str, config: dict[str, Any] | None = None, size: int = 10000, env_id: str = "",
                 agents: dict[str, dict] | None = None, harness: str = "rlcli-host",
                 renderer: dict[str, Any] | None = None, env_config: dict[str, Any] | None = None):
        self.taskset_id, self.taskset_config, self.env_id = taskset, dict(config or {}), env_id
        self.agents, self.harness, self.renderer = dict(agents or {}), harness, renderer
        self.env_config = dict(env_config or {})
        self._vf_env = self._loop = None
        self._lock = threading.Lock()
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

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def sample_task(self, rng: random.Random) -> Task:
        return self.task(rng.randrange(len(self.tasks)))

    def task(self, index: int) -> Task:
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

    # ------------------------------------------------------------------ the HTTP path
    def _start(self):
        """verifiers' Env, serving on an event loop of its own (its interception, shared tools)."""
        with self._lock:
            if self._vf_env is not None:
                return
            import verifiers.v1 as vf
            from verifiers.v1.configs.agent import agent_config_fields

            from rlcli.envs.verifiers_http import install_client

            install_client()
            data: dict[str, Any] = {**self.env_config, "id": self.env_id,
                                    "taskset": {"id": self.taskset_id, **self.taskset_config}}
            try:
                cls = vf.env_config_type(self.taskset_id, self.env_id)
                for role in agent_config_fields(cls()):
                    role_cfg = {"harness": {"id": self.harness}, "runtime": {"type": "subprocess"}}
                    role_cfg.update(self.agents.get(role, {}))
                    data[role] = role_cfg
                env = vf.load_environment(vf.resolve_env_config(data))
            except Exception as e:  # a bad env id or role setting, in verifiers' words
                raise ConfigError(f"env verifiers: env.args.env_id={self.env_id!r} / env.args.agents: "
                                  f"{type(e).__name__}: {e}") from None
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="verifiers", daemon=True).start()
            self._serving = env.serving()
            asyncio.run_coroutine_threadsafe(self._serving.__aenter__(), loop).result()
            self._vf_env, self._loop = env, loop

    def run_group(self, task: Task, n: int, endpoint: str, model: str, tokenizer: str, sampling: dict[str, Any],
                  cache_salt: str, version_floor: int) -> concurrent.futures.Future:
        """Run ``n`` verifiers episodes of ``task`` against the rl-infer at ``endpoint``; the
        future's result is their samples (:class:`rlcli.envs.verifiers_http.Sample`), in episode order."""
        self._start()
        return asyncio.run_coroutine_threadsafe(
            self._run_group(task, n, endpoint, model, tokenizer, sampling, cache_salt, version_floor), self._loop)

    async def _run_group(self, task, n, endpoint, model, tokenizer, sampling, cache_salt, version_floor):
        import verifiers.v1 as vf

        from rlcli.envs.verifiers_http import RlInferClientConfig, episode_samples

        client_cfg = RlInferClientConfig(base_url=f"{endpoint}/v1", api_key_var="RLCLI_INFER_API_KEY",
                                         renderer_model_name=tokenizer, renderer=self.renderer)
        ctx = vf.ModelContext(model=model, client=client_cfg, sampling=vf.Sampling(**sampling, cache_salt=cache_salt))
        vtask = self.tasks[task.info["index"]]
        episodes = await asyncio.gather(*(self._vf_env.run_episode(vtask, ctx) for _ in range(n)))
        return [episode_samples(ep, version_floor) for ep in episodes]

    def close(self) -> None:
        if self._vf_env is not None:
            asyncio.run_coroutine_threadsafe(self._serving.__aexit__(None, None, None), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._vf_env = None

