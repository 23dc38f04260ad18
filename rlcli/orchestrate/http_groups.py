"""Groups whose episodes the environment runs itself, against rl-infer's HTTP API.

An environment with ``run_group`` (verifiers': :class:`rlcli.envs.verifiers_adapter.VerifiersEnv`)
drives its own episodes when rl-infer serves HTTP (``infer.http_port`` >= 0): the loop hands
it a task, a server's HTTP endpoint (the one with the fewest groups running), the sampling
settings and the group's cache salt, and gets back, per episode, samples with the exact
token ids the server saw and sampled, loss masks (True on sampled tokens only), logprobs,
per-token policy versions and the environment's reward. They run on the environment's own
event loop, off the dispatch loop; :meth:`HttpGroups.poll` collects finished groups.

A group's prompt is the longest token prefix all its samples share before their first
sampled token; the rest of each sample is its completion, with its mask. An episode that
verifiers failed is scored ``env.on_error``; a group that came back with no sample (every
episode failed before the model's first turn) is logged and dropped, and the dispatch cap
lets the loop send another.
"""

from pathlib import Path

from rlcli.config import RecipeConfig
from rlcli.errors import ConfigError
from rlcli.logging import setup_logging
from rlcli.orchestrate.rollouts import Group
from rlcli.protocol import Completion
from rlcli.transport.registry import list_entries
from rlcli.transport.rundir import RunDir

log = setup_logging("rl-orchestrate")


def uses_http(cfg: RecipeConfig, env) -> bool:
    """Whether the loop hands ``env`` whole groups to run over HTTP."""
    return cfg.infer.http_port >= 0 and callable(getattr(env, "run_group", None))


class HttpGroups:
    def __init__(self, cfg: RecipeConfig, env, run: RunDir):
        if cfg.r3:
            raise ConfigError(f"env {cfg.env.name} runs its episodes over HTTP, which returns no expert routes; "
                              "set r3 = false, or infer.http_port = -1 to let the loop generate")
        self.cfg, self.env, self.run = cfg, env, run
        self.model = Path(cfg.model.path).name or cfg.name  # the name rl-infer serves
        self.pending: dict[int, tuple[Group, object, str]] = {}  # id(group) -> (group, future, server)
        self.waiting: list[Group] = []  # no HTTP server registered yet
        self.reset_stats()

    def reset_stats(self) -> None:
        self.num_errors = 0
        self.num_turns = 0  # model turns after an episode's first
        self.turn_prompt_tokens = 0
        self.turn_cached_tokens = 0
        self.turn_earlier_kv_tokens = 0

    @property
    def groups(self) -> list[Group]:
        return [g for g, _, _ in self.pending.values()] + self.waiting

    def _servers(self) -> dict[str, str]:
        entries = list_entries(self.run.registry_dir(), "infer")
        return {e.endpoints["http"]: e.key for e in entries if e.endpoints.get("http")}

    def submit(self, group: Group) -> None:
        self.waiting.append(group)
        self._start_waiting()

    def _start_waiting(self) -> None:
        if not self.waiting:
            return
        servers = self._servers()
        if not servers:
            return
        load = {url: 0 for url in servers}
        for _, _, url in self.pending.values():
            if url in load:
                load[url] += 1
        for group in self.waiting:
            s = group.sampling or self.cfg.orchestrate.sampling
            url = min(load, key=load.get)
            load[url] += 1
            sampling = {"temperature": s.temperature, "top_p": s.top_p,
                        "max_tokens": min(group.task.max_tokens or s.max_tokens, self.cfg.model.max_seq_len)}
            future = self.env.run_group(group.task, group.num_samples or self.cfg.orchestrate.group_size, url, self.model,
                                        str(self.cfg.model.path), sampling, group.cache_salt, group.dispatch_version)
            self.pending[id(group)] = (group, future, url)
        self.waiting = []

    def poll(self) -> list[Group]:
        """Groups whose episodes all finished, scored."""
        self._start_waiting()
        done = []
        for key, (group, future, url) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[key]
            try:
                episodes = future.result()
            except Exception as e:  # the environment's failure: reported by name, the run goes on
                self.num_errors += 1
                log.warning("env %s: a group's episodes failed on %s (%s: %s); dropping it", self.cfg.env.name,
                            url, type(e).__name__, e)
                continue
            if self._fill(group, [s for samples in episodes for s in samples]):
                done.append(group)
        return done

    def _fill(self, group: Group, samples: list) -> bool:
        if not samples:
            self.num_errors += 1
            log.warning("env %s: no episode of a group reached the model; dropping it", self.cfg.env.name)
            return False
        for s in samples:
            if s.error is not None:
                self.num_errors += 1
                log.warning("env %s: %s; scored %r", self.cfg.env.name, s.error, self.cfg.env.on_error)
                s.reward = self.cfg.env.on_error
            for k in range(1, len(s.turn_prompt_tokens)):
                self.num_turns += 1
                self.turn_prompt_tokens += s.turn_prompt_tokens[k]
                self.turn_cached_tokens += s.turn_cached_tokens[k]
                self.turn_earlier_kv_tokens += s.turn_prompt_tokens[k - 1] + s.turn_completion_tokens[k - 1] - 1
        cut = min(s.loss_mask.index(True) for s in samples)
        first = samples[0].token_ids
        n = 0
        while n < cut and all(s.token_ids[n] == first[n] for s in samples):
            n += 1
        group.prompt_ids = first[:n]
        group.completions = [Completion(token_ids=s.token_ids[n:], logprobs=s.logprobs[n:], versions=s.versions[n:],
                                        finish_reason=s.finish_reason) for s in samples]
        failed = [s.error is not None for s in samples]
        mask = self.cfg.env.errors == "mask"  # a failed episode trains nothing
        group.loss_masks = [[False] * (len(s.loss_mask) - n) if bad and mask else s.loss_mask[n:]
                            for s, bad in zip(samples, failed)]
        group.rewards = [s.reward for s in samples]
        group.errored = failed if any(failed) else []
        return True

    def metrics(self) -> dict[str, float]:
        return {"http_env_errors": self.num_errors, "http_turns": self.num_turns,
                "http_turn_cached_fraction": self.turn_cached_tokens / self.turn_prompt_tokens
                if self.turn_prompt_tokens else 0.0,
                "http_turn_kv_reuse": self.turn_cached_tokens / self.turn_earlier_kv_tokens
                if self.turn_earlier_kv_tokens else 0.0}

    def close(self) -> None:
        for _, future, _ in self.pending.values():
            future.cancel()
        close = getattr(self.env, "close", None)
        if callable(close):
            close()
