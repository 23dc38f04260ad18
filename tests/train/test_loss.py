import pytest
import torch

from rlcli.config.train import LossConfig
from rlcli.train.loss import icepop_loss, tis_loss, token_logprobs


def test_token_logprobs_align_with_the_predicted_token():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    lp, ent = token_logprobs(logits, ids, temperature=0.5)
    ref = torch.log_softmax(logits / 0.5, -1)
    assert lp.shape == ids.shape and lp[:, 0].eq(0).all()
    for t in range(1, 5):
        assert torch.allclose(lp[:, t], ref[:, t - 1].gather(-1, ids[:, t:t + 1])[:, 0])
    assert (ent[:, 1:] > 0).all()


def test_icepop_masks_tokens_outside_the_trust_interval():
    cfg = LossConfig(mask_low=0.5, mask_high=2.0)
    infer_lp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    train_p = torch.tensor([[0.5, 0.9, 0.2, 0.1]], requires_grad=True)  # ratios 1, 1.8, 0.4, 0.2
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, m = icepop_loss(train_p.log(), infer_lp, adv, mask, cfg)
    assert m["masked_tokens"].item() == 1  # the 0.4 ratio; the 0.2 one is not a loss token
    # Gradient of -(ratio * A) w.r.t. log p is -ratio * A on kept tokens, 0 elsewhere.
    lp = train_p.detach().log().requires_grad_()
    loss, _ = icepop_loss(lp, infer_lp, adv, mask, cfg)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.0, -1.8, 0.0, 0.0]]))


def test_tis_truncates_instead_of_masking():
    cfg = LossConfig(mask_low=0.5, mask_high=2.0)
    infer_lp = torch.log(torch.tensor([[0.25, 0.5]]))
    lp = torch.log(torch.tensor([[1.0, 0.5]])).requires_grad_()  # ratios 4 (truncated to 2) and 1
    adv = torch.tensor([[1.0, -2.0]])
    loss, m = tis_loss(lp, infer_lp, adv, torch.tensor([[True, True]]), cfg)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-2.0, 2.0]]))
    assert m["masked_tokens"].item() == 0


def test_on_policy_loss_is_the_policy_gradient():
    """With pi_train == pi_infer, icepop's gradient equals REINFORCE's -A * grad log pi."""
    torch.manual_seed(1)
    logits = torch.randn(1, 6, 7, requires_grad=True)
    ids = torch.randint(0, 7, (1, 6))
    adv = torch.randn(1, 6)
    mask = torch.tensor([[False, False, True, True, True, True]])
    lp, _ = token_logprobs(logits, ids, 1.0)
    loss, m = icepop_loss(lp, lp.detach(), adv, mask, LossConfig())
    loss.backward()
    g1 = logits.grad.clone()
    logits.grad = None
    lp, _ = token_logprobs(logits, ids, 1.0)
    (-(lp * adv * mask).sum()).backward()
    assert torch.allclose(g1, logits.grad, atol=1e-6)
    assert m["mismatch_kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_entropy_carries_grad_for_the_bonus():
    torch.manual_seed(2)
    logits = torch.randn(1, 4, 5, requires_grad=True)
    _, ent = token_logprobs(logits, torch.zeros(1, 4, dtype=torch.long), temperature=1.0)
    p = torch.softmax(logits[0, :-1], -1)
    assert torch.allclose(ent[0, 1:], -(p * p.log()).sum(-1), atol=1e-6)
    ent.sum().backward()  # maximizing entropy pushes logits toward uniform
    assert logits.grad[0, :-1].abs().sum() > 0 and logits.grad[0, -1].abs().sum() == 0
