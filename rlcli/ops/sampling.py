"""Batched token sampling: temperature, top-p, greedy, per-row seeds, no host sync (given ``any_top_p``;
a top-p batch over more than 2,048 tokens reads a flag or two, see :func:`top_p_keep`).

Sampling inverts the CDF: one uniform ``u`` per row, and the token is the first whose
cumulative probability (summed in float64) exceeds ``u`` times the row's total, which draws
from ``p`` with one random number per row instead of one per vocabulary entry (the
exponential race ``argmax(p / E)`` drew ``V`` of them, the largest cost of a CPU decode
step's sampling). Tokens of probability 0 (outside the top-p nucleus) are never drawn.
The uniforms are drawn for the whole batch from one generator; rows with their own seed
overwrite theirs from their own generator, so a seeded request samples the same tokens
whatever else is in the batch.

The returned logprob of a sampled token is under the distribution it was drawn from:
``log_softmax(logits / T)``, truncated to the top-p nucleus and renormalized when
``top_p < 1``. The trainer recomputes exactly that (same :func:`top_p_keep`), so the
importance ratio is 1 when both hold the same weights. Greedy rows (T = 0) report
``log_softmax(logits)``.

On CUDA, a batch without top-p draws in one Triton kernel per row (:mod:`rlcli.ops.sampling_kernel`)
from the same uniforms, unless the caller says not to (the engine's ``infer.engine.fused_kernels``);
under Triton's interpreter with ``RLCLI_PAGED_DECODE_ON_CPU=1`` (the engine's kernel tests) on the
CPU as well.
"""

import torch

from rlcli.ops.attention import _PAGED_ON_CPU
from rlcli.ops.batch_invariant import row_cumsum


def _kernel_for(logits: torch.Tensor):
    """:mod:`rlcli.ops.sampling_kernel` where it draws ``logits``' rows, else None."""
    if not (logits.is_cuda or (_PAGED_ON_CPU and logits.device.type == "cpu")):  # the engine's kernels' switch
        return None
    try:
        from rlcli.ops import sampling_kernel
    except (ImportError, OSError):
        return None
    return sampling_kernel


def sample(logits_SV: torch.Tensor, temperature_S: torch.Tensor, top_p_S: torch.Tensor,
           generator: torch.Generator | None = None,
           row_generators: dict[int, torch.Generator] | None = None,
           any_top_p: bool | None = None, greedy_rows: str | None = None,
           kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [S] (int64) and their logprobs [S] (float32). ``any_top_p``: whether some row has
    ``top_p < 1`` (the caller knows it from the requests); left None, it is read from ``top_p_S``,
    which costs one host sync. ``greedy_rows``: ``"all"`` or ``"none"`` where the caller knows that
    every row, or none, has temperature 0 (then the draw, or the argmax, is skipped); None: either.
    ``kernel``: draw with the Triton kernel where it runs (the engine's ``infer.engine.fused_kernels``)."""
    greedy = temperature_S <= 0
    if greedy_rows == "all":  # no draw: the argmax, and its logprob under log_softmax(logits)
        logits = logits_SV.float()
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    top_p = any_top_p if any_top_p is not None else bool((top_p_S < 1).any())
    u = torch.rand(logits_SV.shape[0], 1, generator=generator, dtype=torch.float64, device=logits_SV.device)
    for row, gen in (row_generators or {}).items():
        u[row] = torch.rand(1, generator=gen, dtype=torch.float64, device=logits_SV.device)
    draw = _kernel_for(logits_SV) if kernel and not top_p else None
    if draw is not None:
        return draw.sample_rows(logits_SV, temperature_S, u)
    logits = logits_SV.float()
    temp = torch.where(greedy, torch.ones_like(temperature_S), temperature_S).float()
    logprobs = torch.log_softmax(logits / temp[:, None], dim=-1)
    probs = logprobs.exp()
    if top_p:
        keep = top_p_keep(probs, top_p_S.float()[:, None]) | (greedy | (top_p_S >= 1))[:, None]
        probs = probs.masked_fill(~keep, 0.0)
        logprobs = torch.log_softmax(logprobs.masked_fill(~keep, float("-inf")), dim=-1)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp(max=probs.shape[-1] - 1)
    tokens = sampled if greedy_rows == "none" else torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


NUCLEUS_CANDIDATES = (1024, 16384)
"""How many of a row's most likely tokens :func:`top_p_keep` looks at, tier by tier, before it
sorts the whole row."""


def top_p_keep(probs_V: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Bool mask (shape of ``probs_V``, last dim the vocabulary) of the top-p nucleus: the
    smallest set of most likely tokens whose mass reaches ``top_p`` (the most likely token
    always stays). ``top_p`` is a float or broadcasts against ``probs_V[..., :1]``.

    A row's nucleus is looked for among its most likely tokens first, 1,024 then 16,384 of them
    (:data:`NUCLEUS_CANDIDATES`; a top-k, where sorting 151,936 entries cost ~14 ms a row on one CPU
    core). It is taken from there when its least likely member is more likely than every token left
    out; a row whose nucleus reaches past the last tier (a flat distribution, or ties at the edge) is
    sorted whole. Either way the mask is the whole sort's: the candidates are ordered as the sort
    orders them (by probability, ties in token order), and the nucleus's mass is summed over the
    same members in the same order. Rows are decided on their own, so a row's mask does not depend
    on the rest of the batch (the engine and the trainer batch differently). Costs one host sync per
    tier a row reaches (whether any row goes on) where a row is longer than twice the candidates;
    under torch.compile (the trainer's compiled logprobs) rows are sorted whole instead."""
    V = probs_V.shape[-1]
    tiers = [k for k in NUCLEUS_CANDIDATES if 2 * k <= V]
    if not tiers or torch.compiler.is_compiling():  # traced: no graph break on the flag
        return _nucleus_by_sort(probs_V, top_p)
    rows = probs_V.reshape(-1, V)
    p_R1 = torch.as_tensor(top_p, dtype=probs_V.dtype, device=probs_V.device)
    p_R1 = p_R1.expand(*probs_V.shape[:-1], 1).reshape(-1, 1)
    keep, settled = _nucleus_among(rows, p_R1, tiers[0])
    left = torch.arange(rows.shape[0], device=rows.device)  # rows still open
    for k in tiers[1:]:
        if bool(settled.all()):
            return keep.view(probs_V.shape)
        left = left[~settled]
        part, settled = _nucleus_among(rows[left], p_R1[left], k)
        keep[left] = part
    if not bool(settled.all()):
        left = left[~settled]
        keep[left] = _nucleus_by_sort(rows[left], p_R1[left])
    return keep.view(probs_V.shape)


def _nucleus_among(rows_RV: torch.Tensor, p_R1: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the nucleus mask of each row found among its ``k`` most likely tokens, whether it is settled
    there): see :func:`top_p_keep`."""
    vals, idx = rows_RV.topk(k, dim=-1)  # the order of ties is unspecified
    idx, by_token = idx.sort(dim=-1)
    sorted_p, order = vals.gather(-1, by_token).sort(dim=-1, descending=True, stable=True)
    cand_token = idx.gather(-1, order)  # by probability, ties in token order: the whole sort's first k
    keep_sorted = (row_cumsum(sorted_p) - sorted_p) < p_R1
    size = keep_sorted.sum(-1, keepdim=True)  # >= 1: the first token's preceding mass is 0
    # Every token outside the candidates is at most the last candidate's probability; tokens
    # above it are all candidates, in the sort's order. A nucleus of only such tokens is settled.
    settled = sorted_p.gather(-1, size - 1)[:, 0] > sorted_p[:, -1]
    return torch.zeros_like(rows_RV, dtype=torch.bool).scatter_(-1, cand_token, keep_sorted), settled


def _nucleus_by_sort(probs_V: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """:func:`top_p_keep` by sorting whole rows."""
    sorted_p, order = probs_V.sort(dim=-1, descending=True, stable=True)  # ties in token order
    cum = row_cumsum(sorted_p.reshape(-1, sorted_p.shape[-1])).view(sorted_p.shape)  # batch_invariant's on CUDA
    keep_sorted = (cum - sorted_p) < top_p
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
