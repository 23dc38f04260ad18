"""Policy-gradient losses with trainer/inference mismatch correction.

The trainer and the inference engine never compute exactly the same probabilities
(different kernels, batch shapes, precision; in async RL also different weights). Each
completion token carries the inference logprob; with ``ratio = pi_train / pi_infer``
per token, the losses here weight the policy gradient by that importance ratio and
keep it inside a trust interval:

* ``icepop``: tokens whose ratio leaves ``[mask_low, mask_high]`` are masked out
  (IcePop / masked importance sampling); inside, the gradient is ``ratio * A * grad log pi``.
* ``tis``: the ratio is truncated at ``mask_high`` instead (truncated importance sampling).
* ``dppo``: the trust region is on the *probability*, and one-sided by the advantage's sign
  (DPPO-Binary-TV, prime-rl 0.6.0's default loss): a token of positive advantage is masked
  when ``pi_train - pi_infer > dppo_mask_high`` (the update already raised it too far), one of
  negative advantage when ``pi_train - pi_infer < -dppo_mask_low``; a token of advantage 0 is
  never masked (it carries no policy gradient). Kept tokens get ``ratio * A * grad log pi``,
  untruncated. A ratio bound treats a rare token whose probability doubles (0.001 -> 0.002)
  like a likely one's (0.4 -> 0.8); the probability's change does not.

All can also mask whole sequences (``sequence_mask_low/high``) whose geometric-mean
ratio leaves an interval, as prime-rl does: one sequence drawn from a very different
distribution is dropped whole instead of token by token. With ``ratio = "sequence"``
(GSPO) all weight every token of a sequence by that geometric-mean ratio instead of
its own, ``exp(lp - sg(lp) + sg(mean log ratio))``: the value is the sequence's, the
gradient each token's ``grad log pi``, and the trust interval (or truncation) acts on the
sequence. The token-level ratios still give the mismatch diagnostics.

With ``kl_tau > 0`` all add prime-rl's KL term, ``kl_tau * (log pi_train - log pi_infer)^2`` on every
loss token (masked ones too: it is what pulls a masked token's probability back), with gradient
``2 kl_tau (log pi_train - log pi_infer) grad log pi``; a token outside the trainer's top-p nucleus
(log pi_train = -inf) adds nothing.

Every loss returns the *sum* over tokens, the boolean mask of the tokens it kept (the
trainer applies the entropy bonus to those only) and mismatch diagnostics, all sums
or counts except ``*_max``; the caller divides by the number of loss tokens in the
whole step (token-level normalization across micro-batches and ranks). A loss of your own
is a function with the signature of :data:`LossFn`, named by ``train.loss.kind =
"package.module:function"`` (:func:`resolve_loss`).
"""

from typing import Callable

import torch

from rlcli.config.train import LossConfig
from rlcli.ops.sampling import top_p_keep

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossConfig],
                  tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
"""(trainer_lp, infer_lp, advantages, loss_mask, seq_ids, cfg) -> (loss sum, kept mask, metrics)."""


def _ratio(trainer_lp: torch.Tensor, infer_lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_ratio = (trainer_lp - infer_lp).clamp(-20, 20)
    return log_ratio.exp(), log_ratio


def sequence_ids(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Index of the packed sequence each token belongs to (a new one starts at position 0)."""
    return (position_ids_BT == 0).long().flatten().cumsum(0).view_as(position_ids_BT) - 1


def _sequence_log_ratio(log_ratio, mask, seq_ids) -> torch.Tensor:
    """Per token, the mean log ratio over its sequence's loss tokens (detached; 0 for a sequence
    without any): the log of the sequence's geometric-mean ratio."""
    lr, m = log_ratio.detach().flatten(), mask.flatten().float()
    ids = seq_ids.flatten()
    n = ids.numel()  # a bound on the sequence count that needs no host sync (ids < tokens)
    total = torch.zeros(n, dtype=lr.dtype, device=lr.device).index_add_(0, ids, lr * m)
    count = torch.zeros(n, dtype=lr.dtype, device=lr.device).index_add_(0, ids, m)
    return (total / count.clamp(min=1))[ids].view_as(log_ratio)


def _sequence_keep(log_ratio, mask, seq_ids, cfg: LossConfig) -> torch.Tensor:
    """False on every token of a sequence whose geometric-mean ratio leaves the sequence interval."""
    if cfg.sequence_mask_low <= 0 and cfg.sequence_mask_high <= 0:
        return torch.ones_like(mask)
    seq_ratio = _sequence_log_ratio(log_ratio, mask, seq_ids).exp()
    ok = torch.ones_like(mask)
    if cfg.sequence_mask_low > 0:
        ok &= seq_ratio >= cfg.sequence_mask_low
    if cfg.sequence_mask_high > 0:
        ok &= seq_ratio <= cfg.sequence_mask_high
    return ok


def _weighting_ratio(trainer_lp, ratio, log_ratio, mask, seq_ids, cfg: LossConfig) -> torch.Tensor:
    """The ratio the policy gradient is weighted by: the token's own, or (``ratio = "sequence"``)
    its sequence's geometric mean in value with the token's own ``grad log pi``. A token the
    trainer gives probability 0 (outside its top-p nucleus) carries no gradient either way."""
    if cfg.ratio == "token":
        return ratio
    own = torch.where(torch.isfinite(trainer_lp), trainer_lp - trainer_lp.detach(), torch.zeros_like(trainer_lp))
    return (own + _sequence_log_ratio(log_ratio, mask, seq_ids)).exp()


def _kl_penalty(trainer_lp, infer_lp, mask, cfg: LossConfig) -> torch.Tensor:
    """``sum over loss tokens of (log pi_train - log pi_infer)^2`` (module docstring), times nothing."""
    finite = mask & torch.isfinite(trainer_lp)
    log_ratio = torch.where(finite, trainer_lp - infer_lp, torch.zeros_like(trainer_lp))
    return (log_ratio.square() * finite).sum()


def _with_kl(loss, trainer_lp, infer_lp, mask, cfg: LossConfig, metrics: dict) -> torch.Tensor:
    if cfg.kl_tau <= 0:
        return loss
    penalty = _kl_penalty(trainer_lp, infer_lp, mask, cfg)
    metrics["kl_penalty"] = penalty.detach()
    return loss + cfg.kl_tau * penalty


def _metrics(ratio, log_ratio, mask, kept, low, high, seq_keep) -> dict[str, torch.Tensor]:
    r, lr = ratio.detach(), log_ratio.detach()
    m, k = mask.float(), kept.float()
    kl = r - 1 - lr  # k3 estimator of KL(pi_infer || pi_train)
    diff = lr.abs() * m
    return {
        "mismatch_kl": (kl * m).sum(),
        "mismatch_kl_kept": (kl * k).sum(),
        "kept_tokens": k.sum(),
        "masked_tokens": (mask & ~kept).float().sum(),
        "masked_low": (mask & low).float().sum(),
        "masked_high": (mask & high).float().sum(),
        "masked_by_sequence": (mask & ~seq_keep).float().sum(),
        "logprob_diff_abs": diff.sum(),
        "logprob_diff_abs_max": diff.max() if diff.numel() else diff.sum(),
        "ratio": (r * m).sum(),
    }


def icepop_loss(trainer_lp, infer_lp, advantages, mask, seq_ids, cfg: LossConfig):
    ratio, log_ratio = _ratio(trainer_lp, infer_lp)
    weighting = _weighting_ratio(trainer_lp, ratio, log_ratio, mask, seq_ids, cfg)
    r = weighting.detach()
    low, high = r < cfg.mask_low, r > cfg.mask_high
    seq_keep = _sequence_keep(log_ratio, mask, seq_ids, cfg)
    kept = mask & ~low & ~high & seq_keep
    loss = -(weighting * advantages * kept).sum()
    metrics = _metrics(ratio, log_ratio, mask, kept, low, high, seq_keep)
    return _with_kl(loss, trainer_lp, infer_lp, mask, cfg, metrics), kept, metrics


def tis_loss(trainer_lp, infer_lp, advantages, mask, seq_ids, cfg: LossConfig):
    ratio, log_ratio = _ratio(trainer_lp, infer_lp)
    weight = _weighting_ratio(trainer_lp, ratio, log_ratio, mask, seq_ids, cfg).detach().clamp(max=cfg.mask_high)
    seq_keep = _sequence_keep(log_ratio, mask, seq_ids, cfg)
    kept = mask & seq_keep
    # exp(lp - lp.detach()) is 1 in value and carries grad log pi; a token outside the trainer's
    # nucleus (lp = -inf, weight 0) carries none (-inf - -inf would make the whole loss NaN).
    own = torch.where(torch.isfinite(trainer_lp), trainer_lp - trainer_lp.detach(), torch.zeros_like(trainer_lp))
    loss = -(weight * own.exp() * advantages * kept).sum()
    none = torch.zeros_like(mask)  # tis truncates: no token is masked by its own ratio
    metrics = _metrics(ratio, log_ratio, mask, kept, none, none, seq_keep)
    return _with_kl(loss, trainer_lp, infer_lp, mask, cfg, metrics), kept, metrics


def dppo_loss(trainer_lp, infer_lp, advantages, mask, seq_ids, cfg: LossConfig):
    ratio, log_ratio = _ratio(trainer_lp, infer_lp)
    weighting = _weighting_ratio(trainer_lp, ratio, log_ratio, mask, seq_ids, cfg)
    moved = trainer_lp.detach().exp() - infer_lp.exp()  # pi_train - pi_infer (0 - p outside the nucleus)
    high = (advantages > 0) & (moved > cfg.dppo_mask_high)
    low = (advantages < 0) & (moved < -cfg.dppo_mask_low)
    seq_keep = _sequence_keep(log_ratio, mask, seq_ids, cfg)
    kept = mask & ~low & ~high & seq_keep
    # A kept token outside the trainer's nucleus (lp = -inf) weighs e^-20 (_ratio's clamp), with no gradient.
    loss = -(weighting * advantages * kept).sum()
    metrics = _metrics(ratio, log_ratio, mask, kept, low, high, seq_keep)
    return _with_kl(loss, trainer_lp, infer_lp, mask, cfg, metrics), kept, metrics


LOSSES: dict[str, LossFn] = {"icepop": icepop_loss, "tis": tis_loss, "dppo": dppo_loss}


def resolve_loss(kind: str) -> LossFn:
    """The loss ``train.loss.kind`` names: a built-in of :data:`LOSSES`, or ``package.module:function``."""
    if kind in LOSSES:
        return LOSSES[kind]
    from rlcli.envs.registry import load_factory

    return load_factory(kind, "train.loss.kind", "function")


def token_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float, top_p: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each next token under ``softmax(logits / T)`` and the entropy of that
    distribution (with grad, for an entropy bonus), both [B, T].

    With ``top_p < 1`` the logprob is under the nucleus the engine sampled from: the
    same truncation (:func:`rlcli.ops.sampling.top_p_keep`), renormalized; a token
    outside the trainer's nucleus gets -inf (its ratio is 0, so the loss masks it).
    Position t scores token t + 1; the last position of each row scores nothing (0).
    """
    logp = torch.log_softmax(logits_BTV[:, :-1].float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    if top_p < 1:
        keep = top_p_keep(logp.detach().exp(), top_p)
        logp = torch.log_softmax(logp.masked_fill(~keep, float("-inf")), dim=-1)
    lp = logp.gather(-1, input_ids_BT[:, 1:, None].long())[..., 0]
    pad = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([pad, lp], dim=1), torch.cat([pad, entropy], dim=1)
