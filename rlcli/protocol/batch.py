"""The training batch: what rl-orchestrate writes to RUN/rollouts/step_N/<rank>.msgpack
and rl-train reads.

Samples are packed into rows of ``micro_batch_tokens`` tokens: several sequences per
row, each starting at position 0, so attention is block-diagonal causal within a row.
Every per-token array has the row's length. ``num_loss_tokens`` counts loss tokens over
all ranks, so each rank can normalize the token-level loss globally without a collective.
"""

from typing import Optional

import msgspec

from rlcli.protocol.messages import WireTensor


class MicroBatch(msgspec.Struct, kw_only=True):
    input_ids: WireTensor
    """int32 [T] tokens of several packed sequences."""
    position_ids: WireTensor
    """int32 [T] position within its own sequence (0 starts a new sequence)."""
    loss_mask: WireTensor
    """bool [T]: True where the token is a completion token the loss trains on."""
    advantages: WireTensor
    """float32 [T] advantage of the sequence each token belongs to."""
    inference_logprobs: WireTensor
    """float32 [T] logprob the inference engine gave each completion token (0 elsewhere)."""
    versions: WireTensor
    """int32 [T] policy version that produced each completion token (-1 on prompt tokens)."""
    routed_experts: Optional[WireTensor] = None
    """uint8/int16 [T, num_moe_layers, top_k] experts chosen at inference (R3), when recorded.
    Per token like input_ids: a context-parallel split slices it along T with the others."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scales its logits by it before log-softmax."""
    top_p: float = 1.0
    """Sampling nucleus mass; below 1 the trainer truncates and renormalizes as the engine did."""
    num_samples: int = 0
    """Sequences packed in this micro-batch."""


class TrainingBatch(msgspec.Struct, kw_only=True):
    step: int
    """Trainer step this batch is for."""
    rank: int
    """Data-parallel rank that reads it."""
    micro_batches: list[MicroBatch]
    """Packed rows for this rank."""
    num_loss_tokens: int
    """Loss tokens in the whole step, across all ranks (the loss normalizer)."""
    num_samples: int
    """Sequences in the whole step, across all ranks."""
    min_version: int
    """Oldest policy version of any token in the step."""
    max_version: int
    """Newest policy version of any token in the step."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TrainingBatch)


def encode_batch(batch: TrainingBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> TrainingBatch:
    return _decoder.decode(data)


# ---------------------------------------------------------------- packing


class Sample(msgspec.Struct, kw_only=True):
    """One sequence before packing (host-side; lists, not tensors)."""

    token_ids: list[int]
    """Prompt + completion."""
    num_prompt_tokens: int
    """Leading prompt tokens (no loss on them)."""
    advantage: float = 0.0
    """Advantage of the whole completion."""
    logprobs: list[float] = []
    """Inference logprob per completion token."""
    versions: list[int] = []
    """Policy version per completion token."""
    routed_experts: Optional[WireTensor] = None
    """[len(token_ids) - 1, layers, top_k] experts, when recorded."""
    loss_mask: list[bool] = []
    """Per completion token: True where the model generated it (trained), False for context the
    environment added between turns; empty means every completion token is trained."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask) if self.loss_mask else len(self.token_ids) - self.num_prompt_tokens


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of the sequences in each row of at most ``capacity`` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"a sequence of {lengths[i]} tokens exceeds train.micro_batch_tokens={capacity}")
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def split_rows(rows: list[list[int]], lengths: list[int], num_ranks: int) -> list[list[list[int]]]:
    """Assign rows to ranks, heaviest first to the least loaded (balanced token counts)."""
    per_rank: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for row in sorted(rows, key=lambda r: -sum(lengths[i] for i in r)):
        r = load.index(min(load))
        per_rank[r].append(row)
        load[r] += sum(lengths[i] for i in row)
    return per_rank


def build_micro_batch(samples: list[Sample], temperature: float, top_p: float = 1.0) -> MicroBatch:
    """Concatenate samples into one packed row."""
    import numpy as np

    ids, pos, mask, adv, lps, vers = [], [], [], [], [], []
    routes = []
    for s in samples:
        n, p = len(s.token_ids), s.num_prompt_tokens
        c = n - p
        ids.extend(s.token_ids)
        pos.extend(range(n))
        adv.extend([0.0] * p + [s.advantage] * c)
        if s.loss_mask:  # a multi-turn episode: environment turns are context, not trained
            assert len(s.loss_mask) == c == len(s.logprobs) == len(s.versions), "per-token lists must cover it"
            mask.extend([False] * p + list(s.loss_mask))
            # Tokens the model did not sample carry no logprob or version, like the prompt's.
            lps.extend([0.0] * p + [lp if t else 0.0 for lp, t in zip(s.logprobs, s.loss_mask)])
            vers.extend([-1] * p + [v if t else -1 for v, t in zip(s.versions, s.loss_mask)])
        else:
            mask.extend([False] * p + [True] * c)
            lps.extend([0.0] * p + list(s.logprobs))
            vers.extend([-1] * p + list(s.versions))
        if s.routed_experts is not None:
            r = s.routed_experts.numpy()
            # Routes exist for every token but the last; the last token's are never used
            # (its output predicts nothing), so repeat the previous row.
            routes.append(np.concatenate([r, r[-1:]], axis=0) if len(r) == n - 1 else r)
    T = WireTensor.from_numpy
    return MicroBatch(
        input_ids=T(np.asarray(ids, dtype=np.int32)), position_ids=T(np.asarray(pos, dtype=np.int32)),
        loss_mask=T(np.asarray(mask, dtype=np.bool_)), advantages=T(np.asarray(adv, dtype=np.float32)),
        inference_logprobs=T(np.asarray(lps, dtype=np.float32)), versions=T(np.asarray(vers, dtype=np.int32)),
        routed_experts=T(np.concatenate(routes)) if routes and len(routes) == len(samples) else None,
        temperature=temperature, top_p=top_p, num_samples=len(samples))
