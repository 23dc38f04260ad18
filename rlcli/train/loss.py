"""Policy-gradient losses with trainer/inference mismatch correction.

The trainer and the inference engine never compute exactly the same probabilities
(different kernels, batch shapes, precision; in async RL also different weights). Each
completion token carries the inference logprob; with ``ratio = pi_train / pi_infer``
per token, the losses here weight the policy gradient by that importance ratio and
keep it inside a trust interval:

* ``icepop``: tokens whose ratio leaves ``[mask_low, mask_high]`` are masked out
  (IcePop / masked importance sampling); inside, the gradient is ``ratio * A * grad log pi``.
* ``tis``: the ratio is truncated at ``mask_high`` instead (truncated importance sampling).

Every loss returns the *sum* over tokens; the caller divides by the number of loss
tokens in the whole step (token-level normalization across micro-batches and ranks).
Add a loss by writing a function with the signature of :data:`LossFn` and registering it
in :data:`LOSSES`.
"""

from typing import Callable

import torch

from rlcli.config.train import LossConfig

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossConfig],
                  tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _ratio(trainer_lp: torch.Tensor, infer_lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_ratio = (trainer_lp - infer_lp).clamp(-20, 20)
    return log_ratio.exp(), log_ratio


def _mismatch_metrics(ratio, log_ratio, mask, kept) -> dict[str, torch.Tensor]:
    r, lr = ratio.detach(), log_ratio.detach()
    m = mask.float()
    return {
        # k3 estimator of KL(pi_infer || pi_train), summed over loss tokens
        "mismatch_kl": ((r - 1 - lr) * m).sum(),
        "masked_tokens": (mask & ~kept).float().sum(),
        "ratio": (r * m).sum(),
    }


def icepop_loss(trainer_lp, infer_lp, advantages, mask, cfg: LossConfig):
    ratio, log_ratio = _ratio(trainer_lp, infer_lp)
    r = ratio.detach()
    kept = mask & (r >= cfg.mask_low) & (r <= cfg.mask_high)
    loss = -(ratio * advantages * kept).sum()
    return loss, _mismatch_metrics(ratio, log_ratio, mask, kept)


def tis_loss(trainer_lp, infer_lp, advantages, mask, cfg: LossConfig):
    ratio, log_ratio = _ratio(trainer_lp, infer_lp)
    weight = ratio.detach().clamp(max=cfg.mask_high)
    # exp(lp - lp.detach()) is 1 in value and carries grad log pi.
    loss = -(weight * (trainer_lp - trainer_lp.detach()).exp() * advantages * mask).sum()
    return loss, _mismatch_metrics(ratio, log_ratio, mask, mask)


LOSSES: dict[str, LossFn] = {"icepop": icepop_loss, "tis": tis_loss}


def token_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each next token under ``softmax(logits / T)`` and the entropy of that
    distribution (with grad, for an entropy bonus), both [B, T].

    Position t scores token t + 1; the last position of each row scores nothing (0).
    """
    logp = torch.log_softmax(logits_BTV[:, :-1].float() / temperature, dim=-1)
    lp = logp.gather(-1, input_ids_BT[:, 1:, None].long())[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    pad = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([pad, lp], dim=1), torch.cat([pad, entropy], dim=1)
