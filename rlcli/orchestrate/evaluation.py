"""Evaluation during training (``orchestrate.eval``): a fixed task set, sampled under the served policy.

The tasks are drawn once, ``num_tasks`` of ``env.sample_task`` with a generator seeded by
``eval.seed`` (the draw ``rl-orchestrate eval`` makes), so every version is measured on the same
tasks (from ``eval.env`` with ``eval.env_args`` where given: a held-out split, a harder setting; its
episodes then run on workers of their own). A *round* starts when the policy the servers serve is due: policy 0, then each time the
served version crosses a multiple of ``interval`` (a version skipped while a round was running is
not evaluated; the next served one is, under its own number), and with ``final`` the last policy.
Its groups go through the orchestrator's dispatch, servers and episodes like training groups
(multi-turn environments included; every turn under the group's cache salt), with their own
sampling settings and ``samples`` completions per task, and are scored by the same reward; they
never join a batch or count against ``max_async``.

A round ends when every group is scored or lost (a first request the server rejected, a group an
HTTP environment dropped): the record appended to RUN/metrics/eval.jsonl has ``step`` = the
evaluated version, pass@1 and pass@k (:func:`rlcli.orchestrate.pipeline.pass_at_k`), the mean
reward and length, the policy versions the tokens actually came from (a new policy may arrive
mid-round; in-flight requests continue under it, as training's do), and the counts of lost tasks
and failed episodes. The completions, decoded, go to RUN/evals/policy_<version>.jsonl as JSON
lines (:func:`rlcli.orchestrate.rollouts.write_samples`), written whole or not at all. A
restarted rl-orchestrate skips versions eval.jsonl already has.
"""

import logging
import random
import time
from typing import Any

import msgspec

from rlcli.config import RecipeConfig
from rlcli.envs import make_env, render_prompt
from rlcli.envs.mix import per_env
from rlcli.errors import ConfigError
from rlcli.orchestrate.episodes import Episodes
from rlcli.orchestrate.pipeline import summarize_eval
from rlcli.orchestrate.rollouts import Group, write_samples
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import new_request_id

log = logging.getLogger("rl-orchestrate")


def eval_recipe(cfg: RecipeConfig) -> RecipeConfig | None:
    """``cfg`` with [env] naming ``orchestrate.eval.env`` (and its args), or None when evaluation uses the
    training environment."""
    e = cfg.orchestrate.eval
    if not e.env:
        return None
    try:
        return msgspec.structs.replace(cfg, env=msgspec.structs.replace(cfg.env, name=e.env, args=dict(e.env_args)))
    except ValueError as err:  # the [env] table's own checks (an unknown name)
        raise ConfigError(f"orchestrate.eval.env: {err}") from None


def make_eval_env(cfg: RecipeConfig):
    """The environment ``orchestrate.eval.env`` names, refused if it runs its own episodes over HTTP."""
    from rlcli.orchestrate.http_groups import uses_http

    recipe = eval_recipe(cfg)
    try:
        env = make_env(recipe.env)
    except ConfigError as e:
        raise ConfigError(f"orchestrate.eval.env: {e}") from None
    if uses_http(recipe, env):
        raise ConfigError(f"orchestrate.eval.env {cfg.orchestrate.eval.env!r} runs its own episodes over HTTP; an "
                          "evaluation environment runs through the loop's episodes")
    return env


class Evaluation:
    def __init__(self, cfg: RecipeConfig, run: RunDir, env: Any, tokenizer: Any, renders_prompts: bool = True,
                 new_id=None):
        """``renders_prompts``: False for an environment that renders its own (the HTTP path). With
        ``orchestrate.eval.env`` the round's tasks come from that environment and its episodes run in
        :attr:`episodes` of their own (``new_id``: the pool's request ids)."""
        self.episodes = None
        recipe = eval_recipe(cfg)
        if recipe is not None:
            env, renders_prompts = make_eval_env(cfg), True
            self.episodes = Episodes(recipe, env, tokenizer, new_id or new_request_id)
            cfg = recipe
        self.cfg, self.ecfg, self.run, self.tokenizer = cfg, cfg.orchestrate.eval, run, tokenizer
        self.sampling = self.ecfg.sampling(cfg.orchestrate.sampling)
        rng = random.Random(self.ecfg.seed)
        self.tasks, self.prompts = [], []
        for _ in range(self.ecfg.num_tasks):
            task = env.sample_task(rng)
            prompt = render_prompt(task, tokenizer, cfg.env) if renders_prompts else []
            if renders_prompts and len(prompt) >= cfg.model.max_seq_len:
                log.warning("eval: leaving out a task whose prompt (%d tokens) fills model.max_seq_len", len(prompt))
                continue
            self.tasks.append(task)
            self.prompts.append(prompt)
        self.done = {int(m["step"]) for m in run.read_metrics("eval") if "step" in m}
        self.last = max(self.done, default=-1)
        self.version: int | None = None  # the round running, if one is
        self.groups: list[Group] = []
        self.finished: set[int] = set()  # id() of the round's groups scored or lost
        self.num_lost = 0
        self.started = 0.0

    @property
    def running(self) -> bool:
        return self.version is not None

    def due(self, version: int) -> bool:
        """Whether ``version`` (served now) is to be evaluated."""
        if version in self.done or not self.tasks:
            return False
        interval = self.ecfg.interval
        return version // interval > self.last // interval or (self.ecfg.final and version == self.cfg.num_steps)

    def waiting_for_final(self) -> bool:
        """The final policy's evaluation is wanted and not yet written (rl-orchestrate stays for it)."""
        return bool(self.ecfg.final and self.tasks and self.cfg.num_steps not in self.done)

    def start(self, version: int) -> list[Group]:
        """The round's groups, one per task, for the dispatcher to send."""
        self.version, self.started, self.num_lost = version, time.monotonic(), 0
        self.finished = set()
        self.groups = [Group(task, prompt, version, sampling=self.sampling, num_samples=self.ecfg.samples,
                             eval_version=version) for task, prompt in zip(self.tasks, self.prompts)]
        log.info("eval: policy v%d, %d tasks x %d samples", version, len(self.groups), self.ecfg.samples)
        return self.groups

    def scored(self, group: Group) -> None:
        self.finished.add(id(group))
        self._maybe_end()

    def sweep(self, pending: list[Group]) -> None:
        """Count as lost the round's groups that are neither pending anywhere nor scored."""
        if not self.running:
            return
        live = {id(g) for g in pending}
        for g in self.groups:
            if id(g) not in live and id(g) not in self.finished:
                self.finished.add(id(g))
                self.num_lost += 1
        self._maybe_end()

    def _maybe_end(self) -> None:
        if len(self.finished) < len(self.groups):
            return
        version, scored = self.version, [g for g in self.groups if g.completions]
        records = [{"rewards": g.rewards, "reward_mean": sum(g.rewards) / len(g.rewards),
                    "versions": [c.versions for c in g.completions]} for g in scored]
        summary = summarize_eval(records, self.ecfg.samples, self.ecfg.threshold)
        lengths = [len(c.token_ids) for g in scored for c in g.completions]
        versions = summary.pop("policy_versions")
        metrics = {"step": version, **summary, "num_tasks_lost": self.num_lost,
                   "env_errors": sum(sum(g.errored) for g in scored),
                   "completion_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
                   **per_env((g.task, g.rewards) for g in scored),
                   "token_version_min": versions[0] if versions else version,
                   "token_version_max": versions[-1] if versions else version,
                   "eval_s": time.monotonic() - self.started, "time": time.time()}
        samples = write_samples(self.run.root / "evals" / f"policy_{version}.jsonl", scored, self.tokenizer)
        self.run.append_metrics("eval", metrics)
        self.run.mirror_samples("eval", version, samples)
        log.info("eval: policy v%d pass@1 %s pass@%d %s reward %s (%d tasks, %d lost, %.1fs)", version,
                 _fmt(metrics["pass@1"]), self.ecfg.samples, _fmt(metrics[f"pass@{self.ecfg.samples}"]),
                 _fmt(metrics["reward_mean"]), len(scored), self.num_lost, metrics["eval_s"])
        self.done.add(version)
        self.last = max(self.last, version)
        self.version, self.groups, self.finished = None, [], set()


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
