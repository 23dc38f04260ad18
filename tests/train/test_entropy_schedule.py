import pytest

from rlcli.config.train import LossConfig
from rlcli.train.trainer import loss_config_at


def test_linear_entropy_schedule_falls_from_the_coefficient_to_zero():
    cfg = LossConfig(entropy_coef=0.01, entropy_schedule="linear")
    coefs = [loss_config_at(cfg, step, 11).entropy_coef for step in range(1, 12)]
    assert coefs[0] == 0.01 and coefs[-1] == 0.0
    assert coefs[5] == pytest.approx(0.005)
    assert all(a > b for a, b in zip(coefs, coefs[1:]))
    assert loss_config_at(cfg, 12, 11).entropy_coef == 0.0  # past num_steps: no bonus
    assert loss_config_at(cfg, 5, 11).mask_high == cfg.mask_high  # the other settings are kept


def test_constant_entropy_schedule_keeps_the_coefficient():
    cfg = LossConfig(entropy_coef=0.01)
    assert all(loss_config_at(cfg, step, 11) is cfg for step in (1, 6, 11))
