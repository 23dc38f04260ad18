"""Groups of completions (episodes), the packed batch files written for the trainer, and readable
samples of groups (JSON lines of text)."""

import json

from dataclasses import dataclass, field
from typing import Any

from rlcli.envs import Task
from rlcli.protocol import Completion
from rlcli.protocol.batch import Sample, TrainingBatch, build_micro_batch, encode_batch, pack_samples
from rlcli.transport.atomic import atomic_dir, atomic_write_bytes
from rlcli.transport.checksum import checksum
from rlcli.transport.rundir import RunDir


@dataclass
class Group:
    """One prompt and its ``group_size`` completions."""

    task: Task
    prompt_ids: list[int]
    dispatch_version: int
    completions: list[Completion] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    loss_masks: list[list[bool]] = field(default_factory=list)
    """Per completion and completion token: trained (model) or context (environment turn);
    empty when every completion token is the model's."""
    errored: list[bool] = field(default_factory=list)
    """Per completion, whether its environment failed (scored env.on_error); empty when none did.
    With env.errors = "mask" such a completion's loss is masked and its reward left out of the
    group's baseline (:meth:`rlcli.orchestrate.loop.Orchestrator.on_scored`)."""
    episodes: list = field(default_factory=list)
    """Per completion, its :class:`rlcli.orchestrate.episodes.Episode` while it runs."""
    cache_salt: str = ""
    """Prefix-cache namespace of every turn of the group's episodes."""
    sampling: Any = None
    """Its :class:`~rlcli.config.orchestrate.SamplingConfig` when not the recipe's
    orchestrate.sampling: an evaluation's (orchestrate.eval)."""
    num_samples: int = 0
    """Completions of its prompt; 0: orchestrate.group_size."""
    eval_version: int | None = None
    """The policy version a group of a scheduled evaluation evaluates; such a group never joins a batch."""
    token_advantages: list[list[float]] = field(default_factory=list)
    """Per completion and completion token, the teacher's term added to its advantage (orchestrate.teacher);
    empty when no teacher scored the group."""

    @property
    def min_version(self) -> int:
        """Oldest policy that produced any token of the group."""
        return min(min(c.versions, default=self.dispatch_version) for c in self.completions)

    @property
    def max_version(self) -> int:
        return max(max(c.versions, default=self.dispatch_version) for c in self.completions)

    def samples(self) -> list[Sample]:
        masks = self.loss_masks or [[]] * len(self.completions)
        terms = self.token_advantages or [[]] * len(self.completions)
        return [Sample(token_ids=self.prompt_ids + c.token_ids, num_prompt_tokens=len(self.prompt_ids),
                       advantage=a, logprobs=c.logprobs, versions=c.versions, routed_experts=c.routed_experts,
                       loss_mask=m, token_advantages=t)
                for c, a, m, t in zip(self.completions, self.advantages, masks, terms)]


def write_samples(path, groups: list[Group], tokenizer) -> list[dict]:
    """``groups`` as JSON lines a person (or jq) reads: per group its task's ``prompt`` and ``answer``,
    each completion decoded (a multi-turn episode's environment turns included), its ``rewards``, and
    where known its ``advantages`` and ``errored`` flags and the policy versions of its tokens; written
    whole or not at all. Returns the records."""
    records = []
    for g in groups:
        record = {"prompt": g.task.prompt, "answer": g.task.answer,
                  "completions": [tokenizer.decode(c.token_ids) for c in g.completions], "rewards": g.rewards,
                  "versions": [[min(c.versions, default=g.dispatch_version), max(c.versions, default=g.dispatch_version)]
                               for c in g.completions]}
        if g.advantages:
            record["advantages"] = g.advantages
        if g.errored:
            record["errored"] = g.errored
        records.append(record)
    atomic_write_bytes(path, "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in records).encode(),
                       fsync=False)
    return records


def write_batch(run: RunDir, step: int, groups: list[Group], num_ranks: int, capacity: int,
                temperature: float, top_p: float = 1.0, share_prompts: bool = True) -> dict:
    """Pack ``groups`` into per-rank files under RUN/rollouts/step_<step> (STABLE last); with
    ``share_prompts`` each group's prompt is packed once (rlcli.protocol.batch)."""
    samples = [s for g in groups for s in g.samples()]
    per_rank, num_row_tokens = pack_samples(samples, capacity, num_ranks, share_prompts)
    num_loss_tokens = sum(s.num_loss_tokens for s in samples)
    min_v = min(g.min_version for g in groups)
    max_v = max(g.max_version for g in groups)
    sums: dict[str, str] = {}  # the manifest's checksums, taken on the bytes in memory
    meta = {"step": step, "num_samples": len(samples), "num_ranks": num_ranks}  # the trainer checks its dp
    with atomic_dir(run.rollouts_dir(step), meta, sums) as tmp:
        for rank, rows in enumerate(per_rank):
            micro_batches = [build_micro_batch([samples[i] for i in row], temperature, top_p, share_prompts)
                             for row in rows]
            batch = TrainingBatch(step=step, rank=rank, micro_batches=micro_batches, num_loss_tokens=num_loss_tokens,
                                  num_samples=len(samples), min_version=min_v, max_version=max_v)
            data = encode_batch(batch)
            (tmp / f"{rank}.msgpack").write_bytes(data)
            sums[f"{rank}.msgpack"] = checksum(data)
    return {"num_samples": len(samples), "num_loss_tokens": num_loss_tokens,
            "num_micro_batches": sum(len(r) for r in per_rank), "min_version": min_v, "max_version": max_v,
            "num_row_tokens": num_row_tokens, "num_sample_tokens": sum(len(s.token_ids) for s in samples),
            "batch_checksum": sums["0.msgpack"]}
