"""The RL loop with bounded off-policy asynchrony and no length bias.

Batch N feeds trainer step N, which turns policy N-1 into policy N. With
``k = max_async``, requests for batch N may be dispatched once the inference servers
serve policy >= N - 1 - k, so the orchestrator runs at most k steps ahead of the
trainer; ``k = 0`` is exactly synchronous RL (batch N comes from policy N - 1 alone).

Staleness is controlled at dispatch, as in AReaL: groups consumed + buffered + in
flight never exceed ``(policy + 1 + k) * batch_size``. A group's *deadline* is the last
batch it may join, ``oldest token's version + 1 + bound`` (bound = max_off_policy_steps,
default k); in flight, the version at dispatch stands in for the oldest token (tokens
are only ever newer, so the deadline can only move later). Batches are assembled
earliest-deadline-first, and batch N is written only when what remains (buffered and
in flight) can still meet every deadline in batches N+1, N+2, ...; otherwise it waits
for the stragglers. With the dispatch cap that is always possible, so no group is ever
dropped for staleness: long completions are trained, not traded for speed. The price
is that a step sometimes waits for the slowest group of an old cohort (``straggler_wait_s``);
short completions still never wait for the long tail of their own cohort. A bound above k
separates the two limits, as prime-rl's ``max_off_policy_steps`` does: the cap still keeps the
orchestrator k steps ahead, while a straggler may be trained up to ``bound`` steps late, so it
holds up a batch only once it is that old (docs/asynchrony.md). Nothing is
aborted: a group in flight cannot be proven too old, because its dispatch version is a
lower bound on its oldest token, not an upper one.

Rewards and environment turns never run in this loop: replies go to
:class:`~rlcli.orchestrate.episodes.Episodes`, which runs each completion's episode (tool turns,
then the reward) on worker threads and hands back the next turns' requests and the groups
whose episodes are all scored. A group counts as in flight until then. The loop's wait wakes
at once for a reply, a finished environment call or a ``PolicyUpdated``; each batch written is
announced (``BatchWritten``) on this process's PUB socket, which wakes the waiting trainer.

Restarts: the step counter resumes at ``max(progress, newest STABLE batch) + 1`` (a batch
is written before progress, so none is written twice). A batch at or past the step the
trainer waits for that is missing (the trainer deleted it as corrupt) is written again
from fresh groups. Rollouts are deleted only ``keep_rollouts`` steps behind the trainer
*and* at or before its oldest kept checkpoint, so a trainer restarting from any
checkpoint finds every batch it needs.

Every request carries the policy version at dispatch as its cache salt (every later turn
of its episodes keeps it). The salt only names a prefix-cache namespace: rl-infer also keys
each cached block by the weights version that computed it, so a request that reaches a
server after its swap (before ``PolicyUpdated`` arrives here) does not reuse KV of the
older weights.
"""

import random
import time

from rlcli.config import RecipeConfig
from rlcli.config.recipe import shared_settings
from rlcli.envs import EpochOrder, is_dataset, is_multi_turn, make_env, render_prompt
from rlcli.envs.mix import per_env
from rlcli.errors import ConfigError
from rlcli.logging import setup_logging
from rlcli.models.tokenizer import load_tokenizer
from rlcli.orchestrate.advantages import group_advantages, overlong_penalty
from rlcli.orchestrate.episodes import Episodes
from rlcli.orchestrate.evaluation import Evaluation, make_eval_env
from rlcli.orchestrate.http_groups import HttpGroups, uses_http
from rlcli.orchestrate.pool import InferPool
from rlcli.orchestrate.rollouts import Group, write_batch, write_samples
from rlcli.orchestrate.teacher import Teacher
from rlcli.protocol import BatchWritten, ErrorReply, GenerateRequest, PolicyUpdated, SamplingParams
from rlcli.transport.atomic import clean_temporaries, is_stable, remove_dir
from rlcli.transport.registry import Registration, list_entries
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import Publisher, Subscriber

log = setup_logging("rl-orchestrate")

REFRESH_S = 0.25
MAX_ERROR_BACKOFF_S = 10.0


def percentile(values: list[int], q: int) -> int:
    """The nearest-rank ``q``-th percentile: the smallest value at least ``q`` percent of them do not exceed."""
    ordered = sorted(values)
    return ordered[max(0, -(-q * len(ordered) // 100) - 1)]


def check_env_settings(cfg: RecipeConfig, env) -> None:
    """Refuse settings the environment cannot honour, and an evaluation environment that cannot be built
    (before rl-orchestrate claims the run directory)."""
    if cfg.orchestrate.advantage.overlong_buffer and (is_multi_turn(env) or uses_http(cfg, env)):
        raise ConfigError(f"orchestrate.advantage.overlong_buffer is for single-turn environments and "
                          f"{cfg.env.name} is multi-turn: set it to 0")
    if cfg.orchestrate.eval.interval and cfg.orchestrate.eval.env:
        eval_env = make_eval_env(cfg)
        close = getattr(eval_env, "close", None)
        if callable(close):
            close()


class Orchestrator:
    http: HttpGroups | None = None
    """Groups whose episodes the environment runs itself over rl-infer's HTTP API, if it does."""

    def __init__(self, cfg: RecipeConfig, run: RunDir, env=None, tokenizer=None):
        """``env`` and ``tokenizer``: already built from ``cfg`` (rl-orchestrate run builds them before it
        claims the run directory, so a bad env.args leaves no claim); None builds them here."""
        self.cfg, self.run, self.ocfg = cfg, run, cfg.orchestrate
        self.env = env if env is not None else make_env(cfg.env)
        check_env_settings(cfg, self.env)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model.path)
        self.pool = InferPool(run, self.ocfg.connect, self.ocfg.request_timeout_s)
        self.episodes = Episodes(cfg, self.env, self.tokenizer, self.pool.new_request_id)
        self.http = HttpGroups(cfg, self.env, run) if uses_http(cfg, self.env) else None
        self.evaluation = Evaluation(cfg, run, self.env, self.tokenizer, renders_prompts=self.http is None,
                                     new_id=self.pool.new_request_id) if self.ocfg.eval.interval else None
        self.teacher = Teacher(cfg, run) if self.ocfg.teacher.enabled else None
        if self.ocfg.connect:
            self.pool.check_reachable()
        self.sub = Subscriber()
        self.pub = Publisher(self.ocfg.host, 0)  # BatchWritten wakes the trainer (the STABLE marker is the truth)
        self.registration = Registration(run.registry_dir(), "orchestrate", 0, {"pub": self.pub.endpoint},
                                         {"settings": shared_settings(cfg, "orchestrate")})
        clean_temporaries(run.root / "rollouts")
        progress = run.read_progress("orchestrate")
        done = max(int(progress.get("step", 0)), run.latest_stable("rollouts") or 0)
        self._init_schedule(done + 1, policy_version=-1, tasks_drawn=int(progress.get("tasks_drawn", 0)))

    @classmethod
    def schedule_only(cls, cfg: RecipeConfig, tokenizer=None) -> "Orchestrator":
        """The scheduling state alone, at step 1 under policy 0: the dispatch cap, batch assembly and
        staleness bookkeeping, with no run directory, servers or sockets (``run`` and ``pub`` are
        unset, ``pool`` is None; a caller that exercises a method needing one sets it). For models and tests of the
        schedule: bench/async_ceiling.py, tests/orchestrate/test_staleness.py."""
        self = cls.__new__(cls)
        self.cfg, self.ocfg = cfg, cfg.orchestrate
        self.env = make_env(cfg.env)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model.path)
        self.episodes = Episodes(cfg, self.env, self.tokenizer)
        self.pool = None
        self.evaluation = self.teacher = None
        self._init_schedule(1, policy_version=0)
        return self

    def _init_schedule(self, next_step: int, policy_version: int, tasks_drawn: int = 0) -> None:
        self.turns: dict[str, int] = {}  # request id of a later turn -> its episode's index in the group
        self.next_step = next_step
        self.rng = random.Random(self.cfg.seed * 1_000_003 + next_step)
        # A dataset environment's tasks in epochs, from where the last batch written left them.
        self.order = EpochOrder(self.env.num_tasks, self.cfg.seed, tasks_drawn) \
            if is_dataset(self.env) and self.cfg.env.order == "epochs" else None
        self.policy_version = policy_version
        self.buffer: list[Group] = []
        self.inflight: dict[str, Group] = {}
        self.unsent: list[GenerateRequest] = []
        self.rewrite: list[int] = []  # written steps the trainer still needs that are gone
        self.stopping = False
        self.on_tick = lambda: None  # called once per loop iteration (live dashboard)
        self._next_refresh = 0.0
        self.told_no_sync = False
        self.error_streak = 0  # rl-infer's rejections since its last answer
        self.dispatch_after = 0.0  # new groups wait until then after a rejection
        self.zero_variance_cap = (self.ocfg.advantage.max_zero_variance_drops
                                  if self.ocfg.advantage.max_zero_variance_drops >= 0 else 2 * self.ocfg.batch_size)
        self._reset_step_stats()

    def _reset_step_stats(self) -> None:
        self.step_started = time.monotonic()
        self.gen_tokens = 0
        self.gen_completions = 0
        self.num_dispatched = 0
        self.num_stale = 0
        self.num_redispatched = 0  # requests lost with their server (or on the way) and sent again
        self.num_filtered = 0
        self.num_zero_variance_kept = 0
        self.num_errors = 0
        self.overlong_penalties: list[float] = []
        self.wait_s = 0.0
        self.straggler_since: float | None = None
        self.straggler_wait_s = 0.0
        self.episodes.reset_stats()
        if self.http is not None:
            self.http.reset_stats()
        if getattr(self, "teacher", None) is not None:
            self.teacher.reset_stats()

    # ------------------------------------------------------------------ policy version
    def refresh(self) -> None:
        for request in self.pool.refresh() + self.pool.lost():
            group = self.inflight.pop(request.request_id, None)
            if group is not None:  # the pool said why, in one line per server
                self.num_redispatched += 1
                if request.request_id in self.turns:  # a later turn of one episode: send that turn again
                    self._send_turn(group, self.turns.pop(request.request_id), self.episodes.resend(request))
                else:
                    self._send(group)
        syncs = list_entries(self.run.registry_dir(), "sync")
        for entry in syncs:
            self.sub.connect(entry.endpoints["pub"])
        if self.policy_version < 0 and not syncs and not self.told_no_sync:
            log.info("waiting for rl-sync to announce the first policy: none is registered in %s (start rl-sync, or "
                     "keep \"sync\" in up.processes)", self.run.registry_dir())
            self.told_no_sync = True
        version = self.run.read_progress("sync").get("version")
        if version is not None:
            self._set_policy(int(version))
        self.find_missing()

    def find_missing(self) -> None:
        """Steps already written that the trainer has yet to train and that are gone (deleted as corrupt)."""
        entries = list_entries(self.run.registry_dir(), "train")
        for e in entries:
            if int(e.info.get("dp", self.ocfg.num_train_ranks)) != self.ocfg.num_train_ranks:
                raise ConfigError(f"rl-train runs {e.info['dp']} data-parallel rank(s) but rollout batches are split "
                                  f"for orchestrate.num_train_ranks = {self.ocfg.num_train_ranks}: set "
                                  f"orchestrate.num_train_ranks = {e.info['dp']} for rl-orchestrate")
        trainer = [int(e.info["waiting_for"]) for e in entries if "waiting_for" in e.info]
        low = min(trainer + [int(self.run.read_progress("train").get("step", 0)) + 1])
        rewrite = [s for s in range(low, self.next_step) if not is_stable(self.run.rollouts_dir(s))]
        if rewrite != self.rewrite and rewrite:
            log.warning("rollout batch(es) %s are gone but the trainer needs them; writing them again", rewrite)
        self.rewrite = rewrite

    def _set_policy(self, version: int) -> None:
        if version > self.policy_version:
            self.policy_version = version
            if self.pool is not None:
                self.pool.serve_at_least(version)

    # ------------------------------------------------------------------ dispatch
    def num_to_dispatch(self) -> int:
        if self.policy_version < 0:
            return 0
        last = min(self.policy_version + 1 + self.ocfg.max_async, self.cfg.num_steps)
        want = self.ocfg.batch_size * (last - self.next_step + 1 + len(self.rewrite))
        return max(0, want - len(self.buffer) - len(self._pending_groups()))

    def _pending_groups(self, evaluation: bool = False) -> list[Group]:
        """Groups dispatched and not yet buffered: requests in flight (or unsent), episodes running;
        training's, or with ``evaluation`` the evaluation round's."""
        pending = {id(g): g for g in self.inflight.values()}
        pending.update(self.episodes.groups)
        if self.evaluation is not None and self.evaluation.episodes is not None:
            pending.update(self.evaluation.episodes.groups)
        if self.http is not None:
            pending.update((id(g), g) for g in self.http.groups)
        if self.teacher is not None:
            pending.update(self.teacher.groups)
        return [g for g in pending.values() if (g.eval_version is not None) == evaluation]

    def dispatch(self) -> None:
        for _ in range(self.num_to_dispatch() if time.monotonic() >= self.dispatch_after else 0):
            try:
                task = self.env.task(self.order.next()) if self.order else self.env.sample_task(self.rng)
                if self.http is not None:  # the environment renders its own prompts
                    self._send_http(Group(task, [], self.policy_version))
                    continue
                prompt = render_prompt(task, self.tokenizer, self.cfg.env)
            except Exception as e:  # the environment's failure: reported by name, the run goes on
                log.warning("env %s: sample_task failed (%s: %s); skipping this task", self.cfg.env.name,
                            type(e).__name__, e)
                self.episodes.num_env_errors += 1
                continue
            group = Group(task, prompt, self.policy_version)
            if self.episodes.budget(group) - len(prompt) < 1:
                log.warning("skipping a task whose prompt (%d tokens) fills its episode's token budget "
                            "(env.max_episode_tokens, model.max_seq_len)", len(prompt))
                continue
            self._send(group)
            self.num_dispatched += 1
        self.dispatch_eval()
        while self.unsent and self.pool.submit(self.unsent[0], prefer=self._server_of(self.unsent[0])):
            self.unsent.pop(0)

    def dispatch_eval(self) -> None:
        """Start an evaluation round when the served policy is due one (orchestrate.eval)."""
        ev = self.evaluation
        if ev is None or ev.running or self.policy_version < 0 or not ev.due(self.policy_version):
            return
        for group in ev.start(self.policy_version):
            if self.http is not None and ev.episodes is None:
                group.cache_salt, group.dispatch_version = f"v{self.policy_version}", self.policy_version
                self.http.submit(group)
            else:
                self._send(group)

    def _server_of(self, request: GenerateRequest) -> str:
        """Where a later turn's earlier turns are cached: the server that answered the last one."""
        index = self.turns.get(request.request_id)
        return "" if index is None else self.inflight[request.request_id].episodes[index].server

    def _episodes(self, group: Group) -> Episodes:
        """Where ``group``'s episodes run: an evaluation environment's own (orchestrate.eval.env), or the loop's."""
        if group.eval_version is not None and self.evaluation.episodes is not None:
            return self.evaluation.episodes
        return self.episodes

    def _max_tokens(self, group: Group) -> int:
        """The completion budget of ``group``'s requests: its task's or the sampling's, within its episode's."""
        s = group.sampling or self.ocfg.sampling
        return min(group.task.max_tokens or s.max_tokens, self._episodes(group).budget(group) - len(group.prompt_ids))

    def _send(self, group: Group) -> None:
        s = group.sampling or self.ocfg.sampling
        max_tokens = self._max_tokens(group)
        group.cache_salt = f"v{self.policy_version}"
        request = GenerateRequest(
            request_id=self.pool.new_request_id(), prompt_ids=group.prompt_ids, cache_salt=group.cache_salt,
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=max_tokens,
                                    n=group.num_samples or self.ocfg.group_size, ignore_eos=group.task.ignore_eos,
                                    return_routing=self.cfg.r3))
        group.dispatch_version = self.policy_version
        self.inflight[request.request_id] = group
        self.unsent.append(request)

    def _send_http(self, group: Group) -> None:
        group.cache_salt = f"v{self.policy_version}"
        group.dispatch_version = self.policy_version
        self.http.submit(group)
        self.num_dispatched += 1

    def _send_turn(self, group: Group, index: int, request: GenerateRequest) -> None:
        self.inflight[request.request_id] = group
        self.turns[request.request_id] = index
        self.unsent.append(request)

    # ------------------------------------------------------------------ completions
    def on_reply(self, request: GenerateRequest, reply, server: str = "") -> None:
        group = self.inflight.pop(request.request_id, None)
        index = self.turns.pop(request.request_id, None)
        if group is None:
            return
        if isinstance(reply, ErrorReply):
            self.num_errors += 1
            self.error_streak += 1
            # A rejection that repeats (every prompt too long for the server, a setting it refuses)
            # would otherwise be re-dispatched as fast as it comes back: new groups wait, 0.1 s after
            # the first and twice as long after each next one, up to MAX_ERROR_BACKOFF_S.
            backoff = min(MAX_ERROR_BACKOFF_S, 0.1 * 2 ** min(self.error_streak - 1, 10))
            self.dispatch_after = time.monotonic() + backoff
            if self.error_streak <= 3 or self.error_streak & (self.error_streak - 1) == 0:
                log.error("rl-infer rejected a request%s: %s; new groups wait %.1fs",
                          f" ({self.error_streak} in a row)" if self.error_streak > 1 else "", reply.message, backoff)
            if index is not None:
                self._episodes(group).failed(group, index, f"rl-infer rejected its turn ({reply.message})")
            return
        self.error_streak = 0
        if group.eval_version is None:  # a step's generation figures are training's
            self.gen_tokens += sum(len(c.token_ids) for c in reply.completions)
            self.gen_completions += len(reply.completions) if index is None else 0
        if index is None:
            self._episodes(group).first_turn(group, reply, server)
        else:
            self._episodes(group).next_turn(group, index, reply, server)
        self.collect()

    def collect(self) -> None:
        """Take what the environment finished: next turns to send, groups scored."""
        for episodes in (self.episodes, *([self.evaluation.episodes] if self.evaluation is not None and
                                         self.evaluation.episodes is not None else [])):
            requests, ready = episodes.poll()
            for group, index, request in requests:
                self._send_turn(group, index, request)
            for group in ready:
                self.on_scored(group)
        if self.http is not None:
            for group in self.http.poll():
                if group.eval_version is None:
                    self.gen_tokens += sum(sum(m) for m in group.loss_masks)
                    self.gen_completions += len(group.completions)
                self.on_scored(group)
        if self.teacher is not None:
            self.buffer += self.teacher.poll()
        if self.evaluation is not None:
            self.evaluation.sweep(self._pending_groups(evaluation=True))

    def on_scored(self, group: Group) -> None:
        if group.eval_version is not None:
            return self.evaluation.scored(group)
        # env.errors = mask: the baseline is that of the episodes whose environment did not fail.
        counted = [not bad for bad in group.errored] if group.errored and self.cfg.env.errors == "mask" \
            else [True] * len(group.rewards)
        rewards = [r for r, c in zip(group.rewards, counted) if c]
        a = self.ocfg.advantage
        if a.overlong_buffer:  # DAPO's soft overlong punishment, on the rewards the advantages see
            limit = self._max_tokens(group)
            penalties = [overlong_penalty(len(c.token_ids), limit, a.overlong_buffer, a.overlong_penalty)
                         for c, k in zip(group.completions, counted) if k]
            self.overlong_penalties += penalties
            rewards = [r + p for r, p in zip(rewards, penalties)]
        if self.ocfg.advantage.skip_zero_variance and (not rewards or max(rewards) == min(rewards)):
            if self.num_filtered < self.zero_variance_cap:
                self.num_filtered += 1
                return
            if not self.num_zero_variance_kept:
                log.warning("step %d: %d zero-variance groups dropped (advantage.max_zero_variance_drops); "
                            "the rest join the batch with zero advantage", self.next_step, self.num_filtered)
            self.num_zero_variance_kept += 1
        advantages = iter(group_advantages(rewards, self.ocfg.advantage.std_normalize) if rewards else [])
        group.advantages = [next(advantages) if c else 0.0 for c in counted]
        if self.teacher is not None:  # the buffer takes it once the teacher has scored its tokens
            return self.teacher.submit(group)
        self.buffer.append(group)

    def deadline(self, group: Group) -> int:
        """Last batch ``group`` may join: its oldest token must be from policy >= N - 1 - bound."""
        version = group.min_version if group.completions else group.dispatch_version
        return version + 1 + self.ocfg.off_policy_bound

    def select_batch(self) -> list[Group] | None:
        """Batch ``next_step`` earliest-deadline-first, or None while waiting is needed: fewer
        than batch_size groups are ready, or taking them would leave a straggler (buffered or in
        flight) unable to meet its deadline in the batches after this one."""
        step, size = self.next_step, self.ocfg.batch_size
        fresh = [g for g in self.buffer if self.deadline(g) >= step]
        self.num_stale += len(self.buffer) - len(fresh)  # only after a restart or a lost deadline
        self.buffer = fresh
        if len(self.buffer) < size:
            return None
        order = sorted(range(len(self.buffer)), key=lambda i: self.deadline(self.buffer[i]))
        chosen = set(order[:size])
        rest = [self.deadline(g) for i, g in enumerate(self.buffer) if i not in chosen]
        rest += [self.deadline(g) for g in self._pending_groups()]
        rest.sort()
        # Feasible iff for every later batch M, groups due by M fit in batches step+1..M.
        if any(d < step + 1 + j // size for j, d in enumerate(rest)):
            if self.straggler_since is None:
                self.straggler_since = time.monotonic()
            return None
        return [self.buffer[i] for i in sorted(chosen)]

    def try_rewrite(self) -> bool:
        """Write the oldest missing batch again from the earliest-deadline fresh groups."""
        if not self.rewrite:
            return False
        step, size = self.rewrite[0], self.ocfg.batch_size
        groups = sorted((g for g in self.buffer if self.deadline(g) >= step), key=self.deadline)[:size]
        if len(groups) < size:
            return False
        taken = {id(g) for g in groups}
        self.buffer = [g for g in self.buffer if id(g) not in taken]
        info = write_batch(self.run, step, groups, self.ocfg.num_train_ranks, self.cfg.train.micro_batch_tokens,
                           self.ocfg.sampling.temperature, self.ocfg.sampling.top_p, self.ocfg.share_prompts)
        self.pub.publish(BatchWritten(step=step))
        self.run.append_metrics("orchestrate", {**self._metrics(step, groups, info), "rewritten": True})
        self.rewrite.pop(0)
        return True

    def try_write_batch(self) -> bool:
        groups = self.select_batch()
        if groups is None:
            return False
        if self.straggler_since is not None:
            self.straggler_wait_s = time.monotonic() - self.straggler_since
        taken = {id(g) for g in groups}
        self.buffer = [g for g in self.buffer if id(g) not in taken]
        step = self.next_step
        info = write_batch(self.run, step, groups, self.ocfg.num_train_ranks, self.cfg.train.micro_batch_tokens,
                           self.ocfg.sampling.temperature, self.ocfg.sampling.top_p, self.ocfg.share_prompts)
        self.pub.publish(BatchWritten(step=step))
        self.run.write_progress("orchestrate", step=step,
                                **({"tasks_drawn": self.order.position} if self.order else {}))
        self.registration.update(step=step, policy=self.policy_version)
        self.run.append_metrics("orchestrate", self._metrics(step, groups, info))
        if self.ocfg.log_samples:
            records = write_samples(self.run.root / "samples" / f"step_{step}.jsonl", groups[:self.ocfg.log_samples],
                                    self.tokenizer)
            self.run.mirror_samples("orchestrate", step, records)
        self.next_step += 1
        self._reset_step_stats()
        self._retain()
        return True

    def _metrics(self, step: int, groups: list[Group], info: dict) -> dict:
        rewards = [r for g in groups for r in g.rewards]
        lengths = [len(c.token_ids) for g in groups for c in g.completions]
        lags = [step - 1 - g.min_version for g in groups]
        elapsed = time.monotonic() - self.step_started
        m = {
            "step": step, "reward_mean": sum(rewards) / len(rewards),
            "reward_std": (sum((r - sum(rewards) / len(rewards)) ** 2 for r in rewards) / len(rewards)) ** 0.5,
            "completion_len_mean": sum(lengths) / len(lengths), "completion_len_max": max(lengths),
            **{f"completion_len_p{q}": percentile(lengths, q) for q in (50, 90, 99)},
            "off_policy_lag_mean": sum(lags) / len(lags), "off_policy_lag_max": max(lags),
            "generated_len_mean": self.gen_tokens / self.gen_completions if self.gen_completions else 0.0,
            "policy_version": self.policy_version, "num_dispatched": self.num_dispatched,
            "num_stale_dropped": self.num_stale,
            "num_redispatched": self.num_redispatched,
            "dropped_fraction": self.num_stale / max(self.num_dispatched, 1),
            "num_filtered": self.num_filtered, "num_zero_variance_kept": self.num_zero_variance_kept,
            **({"overlong_penalty_mean": sum(self.overlong_penalties) / len(self.overlong_penalties)}
               if self.overlong_penalties else {}),
            "num_errors": self.num_errors, "straggler_wait_s": self.straggler_wait_s, "step_s": elapsed,
            "tokens_per_s": self.gen_tokens / elapsed if elapsed > 0 else 0.0, "wait_s": self.wait_s,
            "time": time.time(), **self.episodes.metrics(), **info,
            **per_env((g.task, g.rewards) for g in groups),  # env.name = "mix": each environment's mean reward
            **({"epoch": self.order.epoch, "tasks_drawn": self.order.position} if self.order else {}),
            **(self.http.metrics() if self.http is not None else {}),
            **(self.teacher.metrics() if self.teacher is not None else {}),
        }
        log.info("step %d reward %.3f len %.1f (generated %.1f) lag %.1f (max %d) dropped %.1f%% tok/s %.0f "
                 "wait %.2fs straggler wait %.2fs", step, m["reward_mean"], m["completion_len_mean"],
                 m["generated_len_mean"], m["off_policy_lag_mean"], m["off_policy_lag_max"],
                 100 * m["dropped_fraction"], m["tokens_per_s"], m["wait_s"], m["straggler_wait_s"])
        return m

    def _retain(self) -> None:
        """Delete batches keep_rollouts behind the trainer that the oldest of its newest train.checkpoint.keep
        checkpoints covers (a milestone further back, train.checkpoint.keep_every, holds none: a trainer sent
        back to one finds its batches missing and they are written again)."""
        trainer_step = int(self.run.read_progress("train").get("step", 0))
        # A damaged newest checkpoint falls back to the one before.
        checkpoint = (self.run.stable_steps("checkpoints")[-self.cfg.train.checkpoint.keep:] or [0])[0]
        for step in self.run.stable_steps("rollouts"):
            if step < trainer_step - self.ocfg.keep_rollouts and step <= checkpoint:
                remove_dir(self.run.rollouts_dir(step))

    # ------------------------------------------------------------------ loop
    def loop(self) -> int:
        announced = False
        self.refresh()
        while (self.next_step <= self.cfg.num_steps or self.rewrite or self._final_eval_due()) and not self.stopping:
            self.registration.beat()
            now = time.monotonic()
            if now >= self._next_refresh:
                self.refresh()
                self._next_refresh = now + REFRESH_S
                if not self.pool.servers and not announced:
                    log.info("waiting for rl-infer servers to register in %s", self.run.registry_dir())
                    announced = True
            while (msg := self.sub.recv(0)) is not None:
                if isinstance(msg, PolicyUpdated):
                    self._set_policy(msg.version)
            self.dispatch()
            idle = not self.inflight and not (self.http is not None and self.http.pending)
            t0 = time.monotonic()
            # Woken at once by a reply, a finished reward or a new policy (none waits out the 20 ms).
            for request, reply, server in self.pool.poll(20, wake=self._wake):
                self.on_reply(request, reply, server)
            self.collect()
            if idle:
                self.wait_s += time.monotonic() - t0  # blocked on the policy gate: nothing to generate
            while self.try_rewrite():
                pass
            while self.next_step <= self.cfg.num_steps and self.try_write_batch():
                pass
            self.on_tick()
        if self.inflight:  # the run is complete: free the servers of groups no batch will take
            self.pool.abort(list(self.inflight))
        return 0

    def _final_eval_due(self) -> bool:
        """After the last batch: the final policy's evaluation (orchestrate.eval.final) is still to come."""
        return self.evaluation is not None and self.evaluation.waiting_for_final()

    @property
    def _wake(self) -> tuple:
        """What ends the loop's wait at once: a policy announcement, and every environment runner's result."""
        runners = [self.episodes.runner.wake_fd]
        if self.evaluation is not None and self.evaluation.episodes is not None:
            runners.append(self.evaluation.episodes.runner.wake_fd)
        return (self.sub.sock, *runners)

    def close(self) -> None:
        if self.teacher is not None:
            self.teacher.close()
        if self.evaluation is not None and self.evaluation.episodes is not None:
            self.evaluation.episodes.runner.close()
        self.episodes.runner.close()
        if self.http is not None:
            self.http.close()
        self.pool.close()
        self.sub.close()
        self.pub.close()
        self.registration.close()
