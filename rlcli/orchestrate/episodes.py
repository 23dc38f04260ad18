"""Episodes: what happens to a group between the server's reply and the batch.

A group's first request asks for ``group_size`` completions of its prompt (they share the
prompt's KV). Each completion then becomes an episode of its own:

- single-turn: the completion is scored, ``reward(task, text)``;
- multi-turn: the environment answers (``respond(task, messages)``); its turn is tokenized
  (:mod:`rlcli.envs.turns`) and appended, and the episode's next request is its whole
  sequence so far: prompt, model and environment tokens, token ids exactly as sampled,
  under the group's cache salt, so the server reuses all KV of the earlier turns. When the
  environment returns None, or ``env.max_turns`` model turns are done, the episode is
  scored, ``reward(task, messages)``.

Environment tokens are context: their loss mask is False (and they carry no logprob or
version), so the trainer trains only what the model generated. Each model turn records
the policy versions of its tokens and how many prompt tokens the server found cached.

Every ``respond`` and ``reward`` call runs on :class:`rlcli.envs.runner.EnvRunner`'s workers,
never in the dispatch loop. A call that fails, or an episode past its time budget, ends
the episode with reward ``env.on_error``; an episode that runs out of tokens is treated
by ``env.truncation``. A group joins the buffer when all its episodes are scored.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from rlcli.config import RecipeConfig
from rlcli.envs import is_multi_turn
from rlcli.envs.runner import EnvRunner, check_reward, check_turn, log
from rlcli.envs.turns import TurnEncoder
from rlcli.orchestrate.rollouts import Group
from rlcli.protocol import Completion, GenerateRequest, GenerateResponse, SamplingParams
from rlcli.transport.zmq import new_request_id


@dataclass
class Turn:
    role: str
    """"model" or "env"."""
    start: int
    """Offset of the turn's first token in the episode's completion tokens."""
    end: int
    """Offset past its last token."""
    num_prompt_tokens: int = 0
    """Model turns: tokens of the request's prompt (everything before the turn)."""
    num_cached_tokens: int = 0
    """Model turns: of those, tokens whose KV the server reused from its prefix cache."""


@dataclass
class Episode:
    started: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    finish_reason: str = ""
    routed_experts: Any = None
    reward: float | None = None
    error: str | None = None
    truncated: bool = False
    server: str = ""
    """The rl-infer server that answered the last model turn: its prefix cache holds the episode
    so far, so the next turn is sent there (see :meth:`rlcli.orchestrate.pool.InferPool.submit`)."""

    @property
    def num_model_turns(self) -> int:
        return sum(t.role == "model" for t in self.turns)

    def turn_versions(self) -> list[list[int]]:
        """The policy versions of each model turn's tokens."""
        return [self.versions[t.start:t.end] for t in self.turns if t.role == "model"]


class Episodes:
    """Runs the episodes of every group whose first reply is in, until each is scored."""

    def __init__(self, cfg: RecipeConfig, env: Any, tokenizer: Any, new_id: Callable[[], str] = new_request_id):
        self.cfg, self.ecfg, self.env, self.tokenizer = cfg, cfg.env, env, tokenizer
        self.new_id = new_id  # the pool's: ids carry the orchestrator's incarnation
        self.runner = EnvRunner(cfg.env.name, cfg.env.num_workers, cfg.env.reward_timeout_s,
                                processes=msgspec.to_builtins(cfg.env) if cfg.env.executor == "processes" else None,
                                retries=cfg.env.retries)
        self.multi_turn = is_multi_turn(env)
        self.encoder = TurnEncoder(tokenizer, cfg.env.use_chat_template) if self.multi_turn else None
        self.groups: dict[int, Group] = {}  # id(group) -> group with episodes not yet scored
        self.ready: list[Group] = []
        self.requests: list[tuple[Group, int, GenerateRequest]] = []
        self.reset_stats()

    def reset_stats(self) -> None:
        self.num_turns = 0  # model turns after the first
        self.cont_prompt_tokens = 0
        self.cont_cached_tokens = 0
        self.cont_earlier_kv_tokens = 0  # KV the previous turns computed: their prompt + completion - 1
        self.num_env_errors = 0
        self.num_truncated = 0
        self.runner.num_timeouts, self.runner.num_retries, self.runner.busy_s = 0, 0, 0.0

    def budget(self, group: Group) -> int:
        """Most tokens of one of ``group``'s episodes, prompt included."""
        limit = self.cfg.model.max_seq_len
        wanted = group.task.max_episode_tokens or self.ecfg.max_episode_tokens or limit
        return min(wanted, limit)

    # ------------------------------------------------------------------ replies
    def first_turn(self, group: Group, reply: GenerateResponse, server: str = "") -> None:
        now = time.monotonic()
        group.episodes = [Episode(started=now, server=server) for _ in reply.completions]
        self.groups[id(group)] = group
        for i, c in enumerate(reply.completions):
            self._model_turn(group, i, c, reply.num_prompt_tokens, reply.num_cached_tokens)

    def next_turn(self, group: Group, index: int, reply: GenerateResponse, server: str = "") -> None:
        group.episodes[index].server = server
        prev = group.episodes[index].turns[-2]  # the model turn before the environment's
        self.cont_earlier_kv_tokens += prev.num_prompt_tokens + prev.end - prev.start - 1
        self.num_turns += 1
        self.cont_prompt_tokens += reply.num_prompt_tokens
        self.cont_cached_tokens += reply.num_cached_tokens
        self._model_turn(group, index, reply.completions[0], reply.num_prompt_tokens, reply.num_cached_tokens)

    def _model_turn(self, group: Group, i: int, c: Completion, num_prompt: int, num_cached: int) -> None:
        ep = group.episodes[i]
        start = len(ep.token_ids)
        ep.token_ids += c.token_ids
        ep.logprobs += c.logprobs
        ep.versions += c.versions
        ep.loss_mask += [True] * len(c.token_ids)
        ep.turns.append(Turn("model", start, len(ep.token_ids), num_prompt, num_cached))
        ep.finish_reason, ep.routed_experts = c.finish_reason, c.routed_experts  # the last turn's routes cover all
        text = self.tokenizer.decode(c.token_ids)
        ep.messages.append({"role": "assistant", "content": text})
        cut = c.finish_reason == "length" and not group.task.ignore_eos
        if not self.multi_turn:
            if cut:
                return self._truncated(group, i)
            return self._submit(group, i, "reward", (group.task, text))
        if cut and len(group.prompt_ids) + len(ep.token_ids) >= self.budget(group):
            return self._truncated(group, i)
        if ep.num_model_turns >= self.ecfg.max_turns:
            return self._submit(group, i, "reward", (group.task, list(ep.messages)))
        self._submit(group, i, "respond", (group.task, list(ep.messages)))

    def _submit(self, group: Group, i: int, what: str, args: tuple) -> None:
        fn, check = (self.env.reward, check_reward) if what == "reward" else (self.env.respond, check_turn)
        self.runner.submit((id(group), i, what), what, fn, args, check, self.ecfg.on_error)

    # ------------------------------------------------------------------ environment results
    def poll(self) -> tuple[list[tuple[Group, int, GenerateRequest]], list[Group]]:
        """Requests for the next model turns, and groups whose episodes are all scored."""
        for (gid, i, what), outcome in self.runner.poll():
            group = self.groups.get(gid)
            if group is None:
                continue
            ep = group.episodes[i]
            if outcome.error is not None:
                self.num_env_errors += 1
                ep.error = outcome.error
                self._scored(group, i, self.ecfg.on_error)
            elif what == "reward":
                self._scored(group, i, outcome.value)
            elif outcome.value is None:
                self._submit(group, i, "reward", (group.task, list(ep.messages)))
            else:
                self._env_turn(group, i, outcome.value)
        requests, self.requests = self.requests, []
        ready, self.ready = self.ready, []
        return requests, ready

    def _env_turn(self, group: Group, i: int, message: dict[str, str]) -> None:
        ep = group.episodes[i]
        timeout = group.task.timeout_s or self.ecfg.episode_timeout_s
        if timeout and time.monotonic() - ep.started > timeout:
            return self.failed(group, i, f"episode ran past its time budget of {timeout}s")
        model_turn = ep.turns[-1]
        try:
            ids = self.encoder.encode(message, ep.token_ids[model_turn.start:model_turn.end])
        except Exception as e:  # the environment's turn cannot be rendered: this episode's failure
            return self.failed(group, i, f"cannot tokenize its turn: {e}")
        room = self.budget(group) - len(group.prompt_ids) - len(ep.token_ids) - len(ids)
        if room < 1:
            return self._truncated(group, i)
        start = len(ep.token_ids)
        ep.token_ids += ids
        ep.logprobs += [0.0] * len(ids)
        ep.versions += [ep.versions[-1] if ep.versions else group.dispatch_version] * len(ids)
        ep.loss_mask += [False] * len(ids)
        ep.turns.append(Turn("env", start, len(ep.token_ids)))
        ep.messages.append(message)
        s = group.sampling or self.cfg.orchestrate.sampling
        request = GenerateRequest(
            request_id=self.new_id(), prompt_ids=group.prompt_ids + ep.token_ids, cache_salt=group.cache_salt,
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, n=1,
                                    max_tokens=min(group.task.max_tokens or s.max_tokens, room),
                                    return_routing=self.cfg.r3))
        self.requests.append((group, i, request))

    def failed(self, group: Group, i: int, error: str) -> None:
        """End episode ``i`` of ``group`` with env.on_error (its turn could not go on)."""
        log.warning("env %s: %s; scored %r", self.ecfg.name, error, self.ecfg.on_error)
        self.num_env_errors += 1
        group.episodes[i].error = error
        self._scored(group, i, self.ecfg.on_error)

    def _truncated(self, group: Group, i: int) -> None:
        ep = group.episodes[i]
        ep.truncated, ep.finish_reason = True, "length"
        self.num_truncated += 1
        if self.ecfg.truncation == "on_error":
            return self._scored(group, i, self.ecfg.on_error)
        if self.ecfg.truncation == "mask":
            ep.loss_mask = [False] * len(ep.loss_mask)
        completion = list(ep.messages) if self.multi_turn else ep.messages[-1]["content"]
        self._submit(group, i, "reward", (group.task, completion))

    def _scored(self, group: Group, i: int, reward: float) -> None:
        group.episodes[i].reward = reward
        if any(ep.reward is None for ep in group.episodes):
            return
        del self.groups[id(group)]
        group.completions = [
            Completion(token_ids=ep.token_ids, logprobs=ep.logprobs, versions=ep.versions,
                       finish_reason=ep.finish_reason, routed_experts=ep.routed_experts)  # last turn: all routes
            for ep in group.episodes]
        group.rewards = [ep.reward for ep in group.episodes]
        if any(ep.error is not None for ep in group.episodes):
            group.errored = [ep.error is not None for ep in group.episodes]
            if self.ecfg.errors == "mask":  # the failure trains nothing
                for ep in group.episodes:
                    if ep.error is not None:
                        ep.loss_mask = [False] * len(ep.loss_mask)
        if self.multi_turn or any(not all(ep.loss_mask) for ep in group.episodes):
            group.loss_masks = [ep.loss_mask for ep in group.episodes]
        self.ready.append(group)

    def resend(self, request: GenerateRequest) -> GenerateRequest:
        """The same turn under a new id (its server was lost)."""
        return msgspec.structs.replace(request, request_id=self.new_id())

    def metrics(self) -> dict[str, float]:
        r = self.runner
        return {"env_errors": self.num_env_errors, "env_timeouts": r.num_timeouts, "env_retries": r.num_retries,
                "env_truncated": self.num_truncated,
                "env_busy_s": r.busy_s, "env_turns": self.num_turns,
                # Of later turns' prompts, the share served from the prefix cache (environment tokens
                # are new, so below 1), and the share of the earlier turns' KV reused (1 up to the
                # last partial KV block of each turn, which a block-granular cache cannot hold).
                "turn_cached_fraction": self.cont_cached_tokens / self.cont_prompt_tokens
                if self.cont_prompt_tokens else 0.0,
                "turn_kv_reuse": self.cont_cached_tokens / self.cont_earlier_kv_tokens
                if self.cont_earlier_kv_tokens else 0.0}
