"""The native engine's per-request state: a :class:`Request` (its sampling settings and completions),
its :class:`Sequence` s (a prompt, then its ``n`` completions after the fork) and each sequence's
:class:`RouteLog` (R3)."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlcli.protocol import Completion, SamplingParams

if TYPE_CHECKING:
    from rlcli.infer.shared_kv import Fetch


@dataclass(eq=False)  # compared by identity: field equality made every `in`/`remove` on a queue a deep compare
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    salt: str
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    completions: list[Completion | None]
    stream: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[float] | None = None  # sampling.prompt_logprobs >= 1: filled as the prefill runs

    @property
    def done(self) -> bool:
        return all(c is not None for c in self.completions)


class RouteLog:
    """One sequence's routes (R3): int16 ``[tokens, MoE layers, top_k]``, for every token it has run
    through the model. A step's rows are one slice copy into a buffer grown by doubling (a list of
    per-step tensors made every full block and every finish concatenate the whole history); a
    prompt's forks share its rows (``shared``, never written) and append their own."""

    __slots__ = ("shared", "own", "n")

    def __init__(self, shared: np.ndarray | None = None):
        self.shared = shared  # rows [0, len(shared))
        self.own: np.ndarray | None = None  # the rows after them: own[:n]
        self.n = 0

    def __len__(self) -> int:
        return self.n + (0 if self.shared is None else len(self.shared))

    def append(self, rows: np.ndarray) -> None:
        k = len(rows)
        if self.own is None or self.n + k > len(self.own):
            grown = np.empty((max(2 * (self.n + k), 64), *rows.shape[1:]), dtype=rows.dtype)
            if self.n:
                grown[:self.n] = self.own[:self.n]
            self.own = grown
        self.own[self.n:self.n + k] = rows
        self.n += k

    def rows(self, a: int, b: int) -> np.ndarray:
        """Rows ``[a, b)``, a copy."""
        s = 0 if self.shared is None else len(self.shared)
        if b <= s:
            return self.shared[a:b].copy()
        if a >= s:
            return self.own[a - s:b - s].copy()
        return np.concatenate([self.shared[a:], self.own[:b - s]])

    def freeze(self) -> np.ndarray | None:
        """Every row as one array, shared from now on (a prompt's forks read it, none writes it)."""
        if self.n:
            self.shared, self.own, self.n = self.rows(0, len(self)), None, 0
        return self.shared


@dataclass(eq=False)  # (identity, as Request)
class Sequence:
    req: Request
    index: int  # completion slot; -1 for a prompt not yet forked into n completions
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full blocks so far
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: RouteLog = field(default_factory=RouteLog)  # of the tokens computed so far (R3)
    partial_versions: set[int] = field(default_factory=set)  # weights that computed the partial last block
    num_streamed: int = 0  # generated tokens already returned in a Delta
    num_published: int = 0  # leading full blocks already in the shared KV store (or handed to it)
    fetch: "Fetch | None" = None  # the shared-store fetch this waiting prompt waits for
    fetched_to: int = 0  # blocks [0, fetched_to) were asked of the shared store since it last held no KV
    pending_hashes: tuple[int, list[bytes]] | None = None  # (version, block hashes) while a fetch is pending

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt_ids)
