"""Shared-prompt packing: the prefix-tree layout of a packed row.

Group-relative RL samples every prompt ``group_size`` times. Unshared packing repeats the
prompt in front of each completion, so the trainer recomputes identical prompt tokens
``group_size`` times. A shared row holds a group's prompt once, then its completions:

    [ prompt[:-1] ] [ prompt[-1] completion_1 ] [ prompt[-1] completion_2 ] ...
      segment a       child of a                  child of a

A row is a sequence of *segments* (contiguous runs of tokens); each segment has a parent
(an earlier segment, or -1). A token sees the tokens of its segment's ancestors and the
earlier tokens of its own segment, never a sibling's. Positions are the true ones: the
children continue from the shared part (``p-1, p, p+1, ...`` for a prompt of ``p``
tokens), so RoPE sees exactly what the unshared row shows it.

Why the last prompt token is repeated: the trainer aligns every value on the *predicting*
position (position t carries token t+1; ``rlcli.train.step``), and a completion's first
token is predicted by the last prompt token. With that token at the head of each child,
every prediction stays inside one segment, its hidden state is computed from the same
keys as in the unshared row, and a row can still be cut anywhere (context parallelism).
The cost is one token per completion.

Groups whose prompts begin alike (a chat template's system message) share that beginning
too: it becomes one more segment, the parent of each group's own prompt segment (a tree of
depth three; ``plan_row``'s ``common``). Only completion tokens carry a loss, so the
prompt segments' last targets, which the row's shift takes from the next segment, are
never trained.

Segments are laid out in pre-order (a parent, then each child's whole subtree), so the
queries that see key ``k`` are one contiguous range ``[k, reach[k])``, where ``reach[k]``
is the end of the subtree of k's segment: the whole mask is ``k <= q < reach[k]``. A plain
packed row (every segment a root) is the document-causal mask, ``reach`` = document end.
"""

from dataclasses import dataclass, field

import numpy as np

Span = tuple[int, int]


@dataclass
class RowTree:
    """Segments of one packed row: ``spans[j] = (start, end)`` (contiguous, covering the
    row, in order) and ``parents[j]`` (an earlier segment, or -1), in pre-order."""

    spans: list[Span]
    parents: list[int]
    _ancestors: list[list[Span]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if len(self.spans) != len(self.parents):
            raise ValueError(f"{len(self.spans)} segments but {len(self.parents)} segment parents")
        open_: list[int] = []  # the current root-to-leaf path
        for j, ((s, e), p) in enumerate(zip(self.spans, self.parents)):
            if e <= s or (j and s != self.spans[j - 1][1]) or (not j and s != 0):
                raise ValueError(f"segment {j} spans [{s}, {e}): segments must be non-empty and contiguous")
            while open_ and open_[-1] != p:
                open_.pop()
            if p != -1 and not open_:
                raise ValueError(f"segment {j} has parent {p}, which is not an open ancestor (pre-order layout)")
            open_.append(j)
        self._ancestors = []
        for j, p in enumerate(self.parents):
            self._ancestors.append(self._ancestors[p] + [self.spans[p]] if p != -1 else [])

    @classmethod
    def from_positions(cls, position_ids_T) -> "RowTree":
        """The unshared layout: a document starts at position 0 (and at the row's first token)."""
        pos = np.asarray(position_ids_T).reshape(-1)
        starts = np.flatnonzero(pos == 0).tolist()
        if not starts or starts[0] != 0:
            starts = [0] + starts
        ends = starts[1:] + [len(pos)]
        return cls(list(zip(starts, ends)), [-1] * len(starts))

    @classmethod
    def from_segments(cls, segment_ids_T, parents_S) -> "RowTree":
        """From per-token segment ids (0, 0, 1, 1, 1, 2, ...) and per-segment parents."""
        seg = np.asarray(segment_ids_T).reshape(-1)
        if len(seg) and (seg[0] != 0 or not np.isin(np.diff(seg), (0, 1)).all()):
            raise ValueError("segment ids must start at 0 and grow by 0 or 1 from token to token")
        starts = np.flatnonzero(np.diff(seg, prepend=-1) != 0).tolist()
        ends = starts[1:] + [len(seg)]
        return cls(list(zip(starts, ends)), [int(p) for p in np.asarray(parents_S).reshape(-1)])

    @property
    def num_tokens(self) -> int:
        return self.spans[-1][1] if self.spans else 0

    @property
    def shared(self) -> bool:
        """Whether any segment has a parent (else: plain document packing)."""
        return any(p != -1 for p in self.parents)

    def ancestors(self, j: int) -> list[Span]:
        """Spans of segment j's ancestors, root first: the keys it sees besides its own."""
        return self._ancestors[j]

    def segment_ids(self) -> np.ndarray:
        """int64 [T]: the segment of every token."""
        return np.repeat(np.arange(len(self.spans)), [e - s for s, e in self.spans])

    def reach(self) -> np.ndarray:
        """int64 [T]: key k is seen by the queries ``k <= q < reach[k]`` (module docstring)."""
        end = [e for _, e in self.spans]
        for j in range(len(self.spans) - 1, -1, -1):  # children come after parents: fold ends upward
            p = self.parents[j]
            if p != -1:
                end[p] = max(end[p], end[j])
        return np.repeat(np.asarray(end, dtype=np.int64), [e - s for s, e in self.spans])

    def leaves(self) -> list[int]:
        """Segments nobody descends from: each is the tail of one sample."""
        has_child = set(self.parents)
        return [j for j in range(len(self.spans)) if j not in has_child]

    def num_unshared_tokens(self) -> int:
        """Tokens the same samples take packed one by one (each leaf with its ancestors)."""
        return sum(e - s + sum(ae - as_ for as_, ae in self.ancestors(j))
                   for j in self.leaves() for s, e in [self.spans[j]])

    def padded(self, num_pad: int) -> "RowTree":
        """This row followed by a padding document of ``num_pad`` tokens (context parallelism)."""
        if not num_pad:
            return self
        T = self.num_tokens
        return RowTree(self.spans + [(T, T + num_pad)], self.parents + [-1])


def dense_mask(tree: RowTree) -> np.ndarray:
    """bool [T, T] (query, key): the reference the attention backends are tested against."""
    reach = tree.reach()
    q = np.arange(tree.num_tokens)[:, None]
    k = np.arange(tree.num_tokens)[None, :]
    return (k <= q) & (q < reach[None, :])


def plan_row(units: list[tuple[int, list[int]]], common: list[tuple[int, int, int]] = ()
             ) -> tuple[list[tuple[int, int, int]], RowTree]:
    """Where each sample's tokens go in a row. ``units``: ``(num_shared, lengths)`` per unit,
    a unit being samples whose first ``num_shared`` tokens are identical (a group's prompt
    minus its last token; 0 or one sample: nothing shared). ``common``: runs ``(first unit,
    end unit, num_common)`` of consecutive units whose samples all share their first
    ``num_common`` tokens (groups whose prompts begin alike: a system message); each run's
    common tokens are one segment, the parent of its units' own segments, and every unit of a
    run must have ``num_shared > num_common`` and more than one sample. Returns the pieces
    ``(sample, start, end)`` (samples numbered across units in order) to concatenate, and the
    tree."""
    pieces, spans, parents = [], [], []
    offset = sample = 0
    runs = {first: (end, n) for first, end, n in common}
    u = 0
    while u < len(units):
        end, start, top = u + 1, 0, -1
        if u in runs:
            end, start = runs[u]
            assert end - u > 1 and start > 0, (u, end, start)
            top = len(spans)
            pieces.append((sample, 0, start))
            spans.append((offset, offset + start))
            parents.append(-1)
            offset += start
        for num_shared, lengths in units[u:end]:
            if num_shared and len(lengths) > 1:
                assert num_shared > start, (num_shared, start)
                root = len(spans)
                pieces.append((sample, start, num_shared))
                spans.append((offset, offset + num_shared - start))
                parents.append(top)
                offset += num_shared - start
                for n in lengths:
                    assert n > num_shared, (n, num_shared)
                    pieces.append((sample, num_shared, n))
                    spans.append((offset, offset + n - num_shared))
                    parents.append(root)
                    offset += n - num_shared
                    sample += 1
            else:
                assert top == -1, "a unit of a common run shares its own prompt"
                for n in lengths:
                    pieces.append((sample, 0, n))
                    spans.append((offset, offset + n))
                    parents.append(-1)
                    offset += n
                    sample += 1
        u = end
    return pieces, RowTree(spans, parents)


def shared_length(num_shared: int, lengths: list[int]) -> int:
    """Row tokens of one unit under :func:`plan_row`."""
    return sum(lengths) - (len(lengths) - 1) * num_shared if num_shared and len(lengths) > 1 else sum(lengths)


@dataclass
class AttentionBucket:
    """Segments attended in one padded SDPA call: ``n`` of them, each with ``Lq`` query and
    ``Lk`` key slots. ``query_index`` [n * Lq] and ``key_index`` [n * Lk] are flat indices
    into the batch's tokens (``b * T + t``; padding slots repeat a real token), ``mask``
    [n, 1, Lq, Lk] which key slot each query slot sees (None: one unpadded segment whose
    keys are its own queries, plain causal)."""

    n: int
    Lq: int
    Lk: int
    query_index: np.ndarray
    key_index: np.ndarray
    mask: np.ndarray | None


def attention_buckets(trees: list[RowTree], max_padded_keys: int = 256
                      ) -> tuple[list[AttentionBucket], np.ndarray]:
    """Every segment of every row as one entry of a batched attention call: its queries, and
    its ancestors' keys then its own (causal on its own part). Segments with at most
    ``max_padded_keys`` keys are grouped by their query count rounded up to a power of two
    and padded to the largest of the group (padding keys are masked out; padding queries
    see one key and are dropped), so a shared row of 4 groups x 8 completions takes a few
    calls instead of one per segment. Longer segments get a call each, unpadded. Returns the
    buckets and ``source`` [B * T]: where each token's output sits in the buckets' outputs
    concatenated (bucket after bucket, ``[n * Lq]`` each)."""
    T = trees[0].num_tokens if trees else 0
    entries: dict[tuple, list] = {}
    for b, tree in enumerate(trees):
        for j, (s, e) in enumerate(tree.spans):
            keys = np.concatenate([np.arange(a, z) for a, z in tree.ancestors(j)] + [np.arange(s, e)]) + b * T
            q = np.arange(s, e) + b * T
            key = (len(keys), b, j) if len(keys) > max_padded_keys else (1 << (len(q) - 1).bit_length(),)
            entries.setdefault(key, []).append((q, keys))
    buckets, source, offset = [], np.zeros(len(trees) * T, dtype=np.int64), 0
    for group in entries.values():
        n, Lq, Lk = len(group), max(len(q) for q, _ in group), max(len(k) for _, k in group)
        qi, ki = np.zeros((n, Lq), dtype=np.int64), np.zeros((n, Lk), dtype=np.int64)
        mask = np.zeros((n, 1, Lq, Lk), dtype=bool)
        for i, (q, keys) in enumerate(group):
            t, m = len(q), len(keys)
            qi[i, :t], qi[i, t:] = q, q[0]
            ki[i, :m], ki[i, m:] = keys, keys[0]
            mask[i, 0, :t, :m] = np.arange(m)[None, :] <= np.arange(m - t, m)[:, None]
            mask[i, 0, t:, 0] = True
            source[q] = offset + i * Lq + np.arange(t)
        plain = n == 1 and Lq == Lk
        buckets.append(AttentionBucket(n, Lq, Lk, qi.ravel(), ki.ravel(), None if plain else mask))
        offset += n * Lq
    return buckets, source
