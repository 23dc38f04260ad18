"""Batched token sampling: temperature, top-p, greedy, per-row seeds, no host sync.

Sampling uses the exponential race (Gumbel-max in another form): ``argmax(p / E)`` with
``E ~ Exp(1)`` draws from ``p``. The noise is drawn for the whole batch from one
generator; rows with their own seed overwrite their noise from their own generator, so
a seeded request samples the same tokens whatever else is in the batch.

The returned logprob of a sampled token is under the temperature-scaled distribution
``log_softmax(logits / T)`` before top-p truncation: exactly what the trainer recomputes.
Greedy rows (T = 0) report ``log_softmax(logits)``.
"""

import torch


def sample(logits_SV: torch.Tensor, temperature_S: torch.Tensor, top_p_S: torch.Tensor,
           generator: torch.Generator | None = None,
           row_generators: dict[int, torch.Generator] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [S] (int64) and their logprobs [S] (float32)."""
    logits = logits_SV.float()
    greedy = temperature_S <= 0
    temp = torch.where(greedy, torch.ones_like(temperature_S), temperature_S).float()
    logprobs = torch.log_softmax(logits / temp[:, None], dim=-1)
    probs = logprobs.exp()
    if bool((top_p_S < 1).any()):
        probs = _top_p(probs, top_p_S.float())
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, gen in (row_generators or {}).items():
        noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def _top_p(probs_SV: torch.Tensor, top_p_S: torch.Tensor) -> torch.Tensor:
    sorted_p, order = probs_SV.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p_S[:, None]
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs_SV).scatter_(-1, order, sorted_p)
