"""The training batch: what rl-orchestrate writes to RUN/rollouts/step_N/<rank>.msgpack
and rl-train reads.

Samples are packed into rows of ``micro_batch_tokens`` tokens: several sequences per
row, each starting at position 0, so attention is block-diagonal causal within a row.
Every per-token array has the row's length. ``num_loss_tokens`` counts loss tokens over
all ranks, so each rank can normalize the token-level loss globally without a collective.

Shared prompts (``share_prompts``): consecutive samples with the same prompt (a group)
are packed as a prefix tree, the prompt once and each completion after it, continuing its
positions (layout and why: :mod:`rlcli.ops.prefix_tree`); consecutive groups of a row whose
prompts begin alike share that beginning once more (:func:`common_prefixes`). Such a row carries
``segment_ids`` and ``segment_parents``; a row without them (and every batch file written
before them) is plain document packing, read as before.
"""

from typing import Optional

import msgspec

from rlcli.ops.prefix_tree import RowTree, plan_row, shared_length
from rlcli.protocol.messages import WireTensor


class MicroBatch(msgspec.Struct, kw_only=True):
    input_ids: WireTensor
    """int32 [T] tokens of several packed sequences."""
    position_ids: WireTensor
    """int32 [T] position within its own sequence (0 starts a new sequence)."""
    loss_mask: WireTensor
    """bool [T]: True where the token is a completion token the loss trains on."""
    advantages: WireTensor
    """float32 [T] advantage of each token: its sequence's, plus its own term where a teacher scored it."""
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
    segment_ids: Optional[WireTensor] = None
    """int32 [T] shared-prompt rows: the segment (0, 1, ... in row order) of each token; None: a
    segment (document) starts at every position 0."""
    segment_parents: Optional[WireTensor] = None
    """int32 [num segments]: the earlier segment each segment extends (-1: none). A token sees
    its segment's ancestors and the earlier tokens of its own segment, never a sibling's."""

    def tree(self) -> RowTree:
        """The row's segments (rlcli.ops.prefix_tree), for either layout."""
        if self.segment_ids is None:
            return RowTree.from_positions(self.position_ids.numpy())
        return RowTree.from_segments(self.segment_ids.numpy(), self.segment_parents.numpy())


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
    token_advantages: list[float] = []
    """Per completion token, added to ``advantage`` (a teacher's term, orchestrate.teacher); empty: none."""
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


def prompt_units(samples: list[Sample], capacity: int | None = None) -> list[tuple[int, list[int]]]:
    """Runs of consecutive samples that share a prompt: ``(num_shared, sample indices)``.

    Samples share when their ``num_prompt_tokens`` and prompt tokens are equal (and, with R3,
    the prompt's routes, so that every token replays exactly its own routes). ``num_shared``
    is the prompt minus its last token (0: nothing to share). With ``capacity``, a run is cut
    so that each unit fits a row of that many tokens."""
    units: list[tuple[int, list[int]]] = []
    for i, s in enumerate(samples):
        shared = s.num_prompt_tokens - 1
        if units and shared > 0 and _same_prompt(samples[units[-1][1][0]], s):
            num, idx = units[-1]
            lengths = [len(samples[j].token_ids) for j in idx + [i]]
            if capacity is None or shared_length(num, lengths) <= capacity:
                units[-1] = (shared, idx + [i])
                continue
        units.append((max(shared, 0), [i]))
    return units


def _same_prompt(a: Sample, b: Sample) -> bool:
    p = a.num_prompt_tokens
    if b.num_prompt_tokens != p or a.token_ids[:p] != b.token_ids[:p]:
        return False
    if (a.routed_experts is None) != (b.routed_experts is None):
        return False
    return a.routed_experts is None or (a.routed_experts.numpy()[:p - 1] == b.routed_experts.numpy()[:p - 1]).all()


def common_prefixes(samples: list[Sample], units: list[tuple[int, list[int]]]) -> list[tuple[int, int, int]]:
    """Runs ``(first unit, end unit, num_common)`` of consecutive shared units (groups) whose
    prompts begin with the same ``num_common`` tokens (and, with R3, the same routes there),
    for :func:`rlcli.ops.prefix_tree.plan_row`. A run grows while its common part stays at
    least one token and shorter than each group's shared part."""
    import numpy as np

    def lcp(a: Sample, b: Sample, limit: int) -> int:
        x, y = np.asarray(a.token_ids[:limit]), np.asarray(b.token_ids[:limit])
        n = min(len(x), len(y))
        diff = np.flatnonzero(x[:n] != y[:n])
        n = int(diff[0]) if len(diff) else n
        if (a.routed_experts is None) != (b.routed_experts is None):
            return 0
        if a.routed_experts is not None and n:
            ra, rb = a.routed_experts.numpy()[:n], b.routed_experts.numpy()[:n]
            bad = np.flatnonzero((ra != rb).reshape(n, -1).any(axis=1))
            n = int(bad[0]) if len(bad) else n
        return n

    runs: list[tuple[int, int, int]] = []
    first, num = None, 0
    for u, (shared, idx) in enumerate(units + [(0, [])]):
        if first is not None and shared > 1 and len(idx) > 1:
            n = min(num, lcp(samples[units[first][1][0]], samples[idx[0]], num), shared - 1)
            if n >= 1:
                num = n
                continue
        if first is not None and u - first > 1:
            runs.append((first, u, num))
        first, num = (u, shared - 1) if shared > 1 and len(idx) > 1 else (None, 0)
    return runs


def pack_samples(samples: list[Sample], capacity: int, num_ranks: int, share_prompts: bool
                 ) -> tuple[list[list[list[int]]], int]:
    """Sample indices of each row of each rank (first-fit decreasing over whole groups when
    ``share_prompts``, else over samples), and the rows' total tokens."""
    units = prompt_units(samples, capacity) if share_prompts else [(0, [i]) for i in range(len(samples))]
    lengths = [shared_length(n, [len(samples[i].token_ids) for i in idx]) for n, idx in units]
    per_rank = split_rows(pack_rows(lengths, capacity), lengths, num_ranks)
    rows = [[[i for u in row for i in units[u][1]] for row in rank] for rank in per_rank]
    return rows, sum(lengths)


def _sample_arrays(s: Sample) -> dict:
    """Per-token arrays of one sample, unpacked (prompt tokens carry no loss)."""
    import numpy as np

    n, p = len(s.token_ids), s.num_prompt_tokens
    c = n - p
    if s.loss_mask:  # a multi-turn episode: environment turns are context, not trained
        assert len(s.loss_mask) == c == len(s.logprobs) == len(s.versions), "per-token lists must cover it"
        mask = [False] * p + list(s.loss_mask)
        # Tokens the model did not sample carry no logprob or version, like the prompt's.
        lps = [0.0] * p + [lp if t else 0.0 for lp, t in zip(s.logprobs, s.loss_mask)]
        vers = [-1] * p + [v if t else -1 for v, t in zip(s.versions, s.loss_mask)]
    else:
        mask, lps, vers = [False] * p + [True] * c, [0.0] * p + list(s.logprobs), [-1] * p + list(s.versions)
    out = {"input_ids": np.asarray(s.token_ids, dtype=np.int32), "position_ids": np.arange(n, dtype=np.int32),
           "loss_mask": np.asarray(mask, dtype=np.bool_),
           "advantages": np.asarray([0.0] * p + ([s.advantage + a for a in s.token_advantages] if s.token_advantages
                                                 else [s.advantage] * c), dtype=np.float32),
           "inference_logprobs": np.asarray(lps, dtype=np.float32), "versions": np.asarray(vers, dtype=np.int32)}
    if s.routed_experts is not None:
        r = s.routed_experts.numpy()
        # Routes exist for every token but the last; the last token's are never used
        # (its output predicts nothing), so repeat the previous row.
        out["routed_experts"] = np.concatenate([r, r[-1:]], axis=0) if len(r) == n - 1 else r
    return out


def build_micro_batch(samples: list[Sample], temperature: float, top_p: float = 1.0,
                      share_prompts: bool = False) -> MicroBatch:
    """Concatenate samples into one packed row; with ``share_prompts``, consecutive samples
    with the same prompt share it (:func:`prompt_units`, module docstring)."""
    import numpy as np

    units = prompt_units(samples) if share_prompts else [(0, [i]) for i in range(len(samples))]
    order = [i for _, idx in units for i in idx]
    common = common_prefixes(samples, units) if share_prompts else []
    pieces, tree = plan_row([(n, [len(samples[i].token_ids) for i in idx]) for n, idx in units], common)
    arrays = [_sample_arrays(samples[i]) for i in order]
    names = [k for k in arrays[0] if all(k in a for a in arrays)] if arrays else []
    row = {k: np.concatenate([arrays[i][k][s:e] for i, s, e in pieces]) for k in names}
    T = WireTensor.from_numpy
    shared = tree.shared
    return MicroBatch(
        **{k: T(row[k]) for k in ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs",
                                  "versions")},
        routed_experts=T(row["routed_experts"]) if "routed_experts" in row else None,
        temperature=temperature, top_p=top_p, num_samples=len(samples),
        segment_ids=T(tree.segment_ids().astype(np.int32)) if shared else None,
        segment_parents=T(np.asarray(tree.parents, dtype=np.int32)) if shared else None)
