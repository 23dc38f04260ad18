"""On-policy distillation (``orchestrate.teacher``): a teacher's servers score the student's completions.

Each training group, once scored by its environment, is sent to the teacher before it joins the
buffer: one request per completion, its prompt the group's prompt followed by the completion's
tokens, asking (``sampling.prompt_logprobs``) for the logprob of every completion token at the
student's sampling temperature. All requests share one cache salt, so the teacher computes a group's
prompt once (its prefix cache, up to the last full block before the completion) and each completion
after it. Each completion token's
advantage then gains ``coef * (teacher logprob - inference logprob)``: the per-token reverse KL to the
teacher, estimated on the token the student sampled (on-policy distillation). Environment turns of a
multi-turn episode are context and get nothing. With ``reward = false`` the group's own advantage is
dropped and the teacher's term is the whole signal.

The teacher's servers are rl-infer processes of their own (their own run directory or fixed
endpoints; vLLM scores at temperature 1 only, so a student sampled at another temperature needs a
native-engine teacher), never in the student's registry, so rl-sync does not update them and
rl-orchestrate sends them no generation. They are reached through an :class:`InferPool` of their own:
requests lost with a server are sent again, and a server's rejection (a sequence too long for the
teacher, say) drops the group, counted as ``teacher_errors``; the dispatch replaces it. While it is
being scored a group counts as in flight (the dispatch cap and the batches' deadlines see it).
"""

import logging
import time

from rlcli.config import RecipeConfig
from rlcli.orchestrate.pool import InferPool
from rlcli.orchestrate.rollouts import Group
from rlcli.protocol import ErrorReply, GenerateRequest, SamplingParams
from rlcli.transport.rundir import RunDir

log = logging.getLogger("rl-orchestrate")

REFRESH_S = 0.25


class Teacher:
    def __init__(self, cfg: RecipeConfig, run: RunDir):
        t = cfg.orchestrate.teacher
        self.coef, self.reward = t.coef, t.reward
        self.temperature = cfg.orchestrate.sampling.temperature
        self.pool = InferPool(RunDir(t.run_dir) if t.run_dir else run, t.connect, cfg.orchestrate.request_timeout_s,
                              owner="orchestrate-teacher", label="the teacher's ")
        if t.connect:
            self.pool.check_reachable()
        self.where = ", ".join(t.connect) if t.connect else f"{t.run_dir}/registry"
        self.waiting: dict[str, tuple[Group, int]] = {}  # request id -> (group, completion index)
        self.groups: dict[int, Group] = {}  # id(group) -> group being scored
        self.scores: dict[int, list[list[float] | None]] = {}
        self.unsent: list[GenerateRequest] = []
        self.told_none = False
        self.next_refresh = 0.0
        self.reset_stats()

    def reset_stats(self) -> None:
        self.num_errors = 0
        self.kl_sum, self.kl_tokens = 0.0, 0

    def submit(self, group: Group) -> None:
        """Ask the teacher about every completion of ``group``; :meth:`poll` hands it back scored."""
        self.groups[id(group)] = group
        self.scores[id(group)] = [None] * len(group.completions)
        salt = "teacher"  # the teacher's weights never change: every request may share cached prefixes
        for i, c in enumerate(group.completions):
            request = GenerateRequest(
                request_id=self.pool.new_request_id(), prompt_ids=group.prompt_ids + c.token_ids, cache_salt=salt,
                sampling=SamplingParams(temperature=self.temperature, max_tokens=1, ignore_eos=True,
                                        prompt_logprobs=len(group.prompt_ids)))
            self.waiting[request.request_id] = (group, i)
            self.unsent.append(request)

    def poll(self) -> list[Group]:
        """Send what waits, take the teacher's answers; the groups now scored, their token terms set."""
        if time.monotonic() >= self.next_refresh:  # the registry read at most every REFRESH_S, as the loop's
            self.next_refresh = time.monotonic() + REFRESH_S
            for request in self.pool.refresh() + self.pool.lost():
                if request.request_id in self.waiting:
                    self.unsent.append(request)
        if self.unsent and not self.pool.servers and not self.told_none:
            log.info("waiting for the teacher's rl-infer servers (%s)", self.where)
            self.told_none = True
        while self.unsent and self.pool.submit(self.unsent[0]):
            self.unsent.pop(0)
        done = []
        for request, reply, _ in self.pool.poll(0):
            entry = self.waiting.pop(request.request_id, None)
            if entry is None:
                continue  # its group was dropped already
            group, i = entry
            if isinstance(reply, ErrorReply) or len(reply.prompt_logprobs) != len(group.completions[i].token_ids):
                why = reply.message if isinstance(reply, ErrorReply) else \
                    f"{len(reply.prompt_logprobs)} logprobs for {len(group.completions[i].token_ids)} tokens"
                self._drop(group, why)
                continue
            scores = self.scores[id(group)]
            scores[i] = reply.prompt_logprobs
            if all(s is not None for s in scores):
                done.append(self._finish(group, scores))
        return done

    def _finish(self, group: Group, scores: list[list[float]]) -> Group:
        del self.groups[id(group)], self.scores[id(group)]
        masks = group.loss_masks or [[]] * len(group.completions)
        group.token_advantages = []
        for c, teacher, mask in zip(group.completions, scores, masks):
            trained = mask or [True] * len(c.token_ids)
            terms = [self.coef * (t - s) if k else 0.0 for t, s, k in zip(teacher, c.logprobs, trained)]
            group.token_advantages.append(terms)
            self.kl_sum += sum(s - t for t, s, k in zip(teacher, c.logprobs, trained) if k)
            self.kl_tokens += sum(trained)
        if not self.reward:
            group.advantages = [0.0] * len(group.completions)
        return group

    def _drop(self, group: Group, why: str) -> None:
        self.num_errors += 1
        if self.num_errors <= 3:
            log.error("the teacher could not score a group (%s); dropping it", why)
        ids = [rid for rid, (g, _) in self.waiting.items() if g is group]
        for rid in ids:
            del self.waiting[rid]
        self.unsent = [r for r in self.unsent if r.request_id not in ids]
        self.pool.abort(ids)
        self.groups.pop(id(group), None)
        self.scores.pop(id(group), None)

    def metrics(self) -> dict[str, float]:
        """teacher_kl: over the tokens the teacher scored in the step's window (absent when it scored none)."""
        return {**({"teacher_kl": self.kl_sum / self.kl_tokens} if self.kl_tokens else {}),
                "teacher_errors": self.num_errors}

    def close(self) -> None:
        if self.waiting:
            self.pool.abort(list(self.waiting))
        self.pool.close()
