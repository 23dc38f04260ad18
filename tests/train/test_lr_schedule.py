import math

import pytest

from rlcli.config.train import OptimConfig
from rlcli.train.trainer import lr_factor


def test_constant_schedule_keeps_the_warm_up_only():
    o = OptimConfig(lr=1e-3, warmup_steps=4)
    assert [lr_factor(s, o, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_starts_after_the_warm_up_and_ends_at_min_lr_ratio(schedule):
    o = OptimConfig(lr=1e-3, warmup_steps=2, schedule=schedule, min_lr_ratio=0.1)
    f = [lr_factor(s, o, 12) for s in range(12)]
    assert f[0] == 0.5 and f[1] == 1.0  # warm-up, decay not started
    assert all(a > b for a, b in zip(f[1:], f[2:]))  # then strictly down
    assert f[-1] == pytest.approx(0.1)  # the last step runs at min_lr_ratio
    mid = 0.55 if schedule == "linear" else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert f[6] == pytest.approx(mid)  # halfway through the 10 decay steps


def test_min_lr_ratio_out_of_range_is_refused():
    with pytest.raises(ValueError, match="min_lr_ratio"):
        OptimConfig(min_lr_ratio=1.5)
