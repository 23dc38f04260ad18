"""Group-relative advantages: each completion is scored against the other completions of
its prompt. Mean-centred (Dr. GRPO) by default; ``std_normalize`` divides by the group's
reward std as in GRPO. :func:`overlong_penalty` is DAPO's soft overlong punishment, added to a
reward before its advantage is taken."""

import statistics


def overlong_penalty(length: int, max_tokens: int, buffer: int, scale: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer`` tokens, then falling linearly
    to ``-scale`` at ``max_tokens`` (a completion cut at its budget gets all of it)."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    return -scale * min(1.0, max(0, length - start) / buffer)


def group_advantages(rewards: list[float], std_normalize: bool = False, eps: float = 1e-6) -> list[float]:
    mean = statistics.fmean(rewards)
    adv = [r - mean for r in rewards]
    if std_normalize and len(rewards) > 1:
        std = statistics.pstdev(rewards)
        adv = [a / (std + eps) for a in adv]
    return adv
