"""Group-relative advantages: each completion is scored against the other completions of
its prompt. Mean-centred (Dr. GRPO) by default; ``std_normalize`` divides by the group's
reward std as in GRPO."""

import statistics


def group_advantages(rewards: list[float], std_normalize: bool = False, eps: float = 1e-6) -> list[float]:
    mean = statistics.fmean(rewards)
    adv = [r - mean for r in rewards]
    if std_normalize and len(rewards) > 1:
        std = statistics.pstdev(rewards)
        adv = [a / (std + eps) for a in adv]
    return adv
