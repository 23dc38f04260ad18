import re

import pytest
import torch

from rlcli.config.train import LossConfig
from rlcli.train.loss import dppo_loss, icepop_loss, sequence_ids, tis_loss, token_logprobs


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


SEQ = torch.zeros(1, 4, dtype=torch.long)


def test_icepop_masks_tokens_outside_the_trust_interval():
    cfg = LossConfig(mask_low=0.5, mask_high=2.0)
    infer_lp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    train_p = torch.tensor([[0.5, 0.9, 0.2, 0.1]], requires_grad=True)  # ratios 1, 1.8, 0.4, 0.2
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, kept, m = icepop_loss(train_p.log(), infer_lp, adv, mask, SEQ, cfg)
    assert m["masked_tokens"].item() == 1  # the 0.4 ratio; the 0.2 one is not a loss token
    assert m["masked_low"].item() == 1 and m["masked_high"].item() == 0
    assert kept.tolist() == [[True, True, False, False]]
    # Gradient of -(ratio * A) w.r.t. log p is -ratio * A on kept tokens, 0 elsewhere.
    lp = train_p.detach().log().requires_grad_()
    loss, _, _ = icepop_loss(lp, infer_lp, adv, mask, SEQ, cfg)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.0, -1.8, 0.0, 0.0]]))


def test_tis_truncates_instead_of_masking():
    cfg = LossConfig(mask_low=0.5, mask_high=2.0)
    infer_lp = torch.log(torch.tensor([[0.25, 0.5]]))
    lp = torch.log(torch.tensor([[1.0, 0.5]])).requires_grad_()  # ratios 4 (truncated to 2) and 1
    adv = torch.tensor([[1.0, -2.0]])
    loss, _, m = tis_loss(lp, infer_lp, adv, torch.tensor([[True, True]]), torch.zeros(1, 2, dtype=torch.long), cfg)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-2.0, 2.0]]))
    assert m["masked_tokens"].item() == 0


@pytest.mark.parametrize("loss_fn, kind", [(icepop_loss, "icepop"), (tis_loss, "tis"), (dppo_loss, "dppo")])
def test_on_policy_loss_is_the_policy_gradient(loss_fn, kind):
    """With pi_train == pi_infer, each loss's gradient equals REINFORCE's -A * grad log pi."""
    torch.manual_seed(1)
    logits = torch.randn(1, 6, 7, requires_grad=True)
    ids = torch.randint(0, 7, (1, 6))
    adv = torch.randn(1, 6)
    mask = torch.tensor([[False, False, True, True, True, True]])
    lp, _ = token_logprobs(logits, ids, 1.0)
    loss, kept, m = loss_fn(lp, lp.detach(), adv, mask, torch.zeros(1, 6, dtype=torch.long), LossConfig(kind=kind))
    assert torch.equal(kept, mask)
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


def test_mismatch_metrics_split_low_high_and_kept():
    """KL on all loss tokens vs on kept ones, masked low/high counts, |d logprob| mean and max."""
    cfg = LossConfig(mask_low=0.5, mask_high=2.0)
    infer_lp = torch.zeros(1, 5)
    lr = torch.tensor([[0.0, 0.1, -1.0, 1.0, 3.0]])  # ratios 1, 1.1, 0.37, 2.7, 20 (last: not a loss token)
    mask = torch.tensor([[True, True, True, True, False]])
    _, kept, m = icepop_loss(lr, infer_lp, torch.ones(1, 5), mask, torch.zeros(1, 5, dtype=torch.long), cfg)
    k3 = lr.exp() - 1 - lr
    assert m["mismatch_kl"].item() == pytest.approx(k3[0, :4].sum().item(), rel=1e-5)
    assert m["mismatch_kl_kept"].item() == pytest.approx(k3[0, :2].sum().item(), rel=1e-5)
    assert (m["masked_low"].item(), m["masked_high"].item(), m["kept_tokens"].item()) == (1, 1, 2)
    assert m["logprob_diff_abs"].item() == pytest.approx(2.1, rel=1e-5)
    assert m["logprob_diff_abs_max"].item() == pytest.approx(1.0)


def test_sequence_mask_drops_whole_sequences_of_a_packed_row():
    """Two sequences packed in one row; the second's geometric-mean ratio is e^-1: with
    sequence_mask_low = 0.5 all its tokens go, even those whose own ratio is inside the interval."""
    cfg = LossConfig(sequence_mask_low=0.5)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    mask = torch.tensor([[False, True, True, False, True, True, True]])
    lr = torch.tensor([[0.0, 0.1, -0.1, 0.0, -0.2, -0.3, -2.5]])
    seq = sequence_ids(pos)
    assert seq.tolist() == [[0, 0, 0, 1, 1, 1, 1]]
    _, kept, m = icepop_loss(lr, torch.zeros(1, 7), torch.ones(1, 7), mask, seq, cfg)
    assert kept.tolist() == [[False, True, True, False, False, False, False]]
    assert m["masked_by_sequence"].item() == 3
    _, kept, _ = icepop_loss(lr, torch.zeros(1, 7), torch.ones(1, 7), mask, seq, LossConfig())
    assert kept.tolist() == [[False, True, True, False, True, True, False]]  # token mask alone


def test_top_p_logprobs_renormalize_over_the_nucleus_with_grad():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]] * 3])).requires_grad_()
    ids = torch.tensor([[0, 1, 3]])
    lp, _ = token_logprobs(logits, ids, 1.0, top_p=0.75)
    assert lp[0, 1].item() == pytest.approx(float(torch.tensor(0.3 / 0.8).log()), rel=1e-5)
    assert lp[0, 2].item() == float("-inf")  # outside the nucleus: ratio 0, masked by the loss
    lp[0, 1].backward()
    assert logits.grad[0, 0, 2:].abs().sum() == 0 and logits.grad[0, 0, :2].abs().sum() > 0


PACKED_POS = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])  # two sequences in one row
PACKED_MASK = torch.tensor([[False, True, True, True, False, True, True]])


def _sequence_ratio_reference(lp, infer_lp, mask, seq):
    """Per token, exp(mean over its sequence's loss tokens of the log ratio)."""
    lr = (lp - infer_lp).detach()
    out = torch.empty_like(lr)
    for i in seq.unique():
        sel = seq == i
        out[sel] = lr[sel & mask].mean().exp()
    return out


@pytest.mark.parametrize("kind", ["icepop", "tis"])
def test_sequence_ratio_weights_every_token_by_its_sequence_with_its_own_gradient(kind):
    """GSPO: d loss / d lp_t = -s_i * A_t on kept tokens, s_i the geometric-mean ratio of t's sequence,
    however far the token's own ratio is from it (the 0.3 and 2.5 tokens would be masked alone)."""
    cfg = LossConfig(kind=kind, ratio="sequence", mask_high=2.0)
    seq = sequence_ids(PACKED_POS)
    infer_lp = torch.full((1, 7), -1.0)
    own = torch.tensor([[0.0, 0.2, -1.2, 0.9, 0.0, 0.1, -0.3]])  # own log ratios
    lp = (infer_lp + own).requires_grad_()
    adv = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0, -2.0, -2.0]])
    loss, kept, m = (icepop_loss if kind == "icepop" else tis_loss)(lp, infer_lp, adv, PACKED_MASK, seq, cfg)
    loss.backward()
    s = _sequence_ratio_reference(lp, infer_lp, PACKED_MASK, seq)
    assert kept.tolist() == PACKED_MASK.tolist()
    torch.testing.assert_close(lp.grad, -s * adv * PACKED_MASK)
    torch.testing.assert_close(loss, -(s * adv * PACKED_MASK).sum())
    assert m["masked_tokens"].item() == 0
    # The token-level ratios still give the mismatch diagnostics.
    k3 = own.exp() - 1 - own
    assert m["mismatch_kl"].item() == pytest.approx((k3 * PACKED_MASK).sum().item(), rel=1e-5)


def test_sequence_ratio_masks_and_truncates_whole_sequences():
    """The first sequence's geometric mean is e^1 (> mask_high 2), the second's e^-0.1: icepop drops
    every token of the first, token ratios inside the interval included; tis weights them by 2."""
    seq = sequence_ids(PACKED_POS)
    own = torch.tensor([[0.0, 0.1, 0.2, 2.7, 0.0, 0.4, -0.6]])
    adv = torch.ones(1, 7)
    _, kept, m = icepop_loss(own, torch.zeros(1, 7), adv, PACKED_MASK, seq, LossConfig(ratio="sequence"))
    assert kept.tolist() == [[False, False, False, False, False, True, True]]
    assert (m["masked_high"].item(), m["masked_low"].item()) == (3, 0)
    _, kept, _ = icepop_loss(own, torch.zeros(1, 7), adv, PACKED_MASK, seq, LossConfig())
    assert kept.tolist() == [[False, True, True, False, False, True, True]]  # token ratios alone
    lp = own.clone().requires_grad_()
    tis_loss(lp, torch.zeros(1, 7), adv, PACKED_MASK, seq, LossConfig(kind="tis", ratio="sequence"))[0].backward()
    assert lp.grad[0, 1:4].tolist() == pytest.approx([-2.0] * 3)
    assert lp.grad[0, 5:].tolist() == pytest.approx([-torch.tensor(-0.1).exp().item()] * 2)


def test_sequence_ratio_on_policy_is_the_policy_gradient_and_a_zero_probability_token_adds_no_nan():
    torch.manual_seed(3)
    logits = torch.randn(1, 7, 9, requires_grad=True)
    ids = torch.randint(0, 9, (1, 7))
    adv = torch.randn(1, 7)
    seq = sequence_ids(PACKED_POS)
    lp, _ = token_logprobs(logits, ids, 1.0)
    icepop_loss(lp, lp.detach(), adv, PACKED_MASK, seq, LossConfig(ratio="sequence"))[0].backward()
    g = logits.grad.clone()
    logits.grad = None
    lp, _ = token_logprobs(logits, ids, 1.0)
    (-(lp * adv * PACKED_MASK).sum()).backward()
    torch.testing.assert_close(g, logits.grad)
    # A token outside the trainer's top-p nucleus has lp = -inf: its sequence is weighted ~0, no NaN.
    for ratio in ("sequence", "token"):
        lp = torch.tensor([[0.0, -0.5, float("-inf"), -0.5, 0.0, -0.2, -0.3]], requires_grad=True)
        loss, _, _ = icepop_loss(lp, torch.full((1, 7), -0.4), adv, PACKED_MASK, seq, LossConfig(ratio=ratio))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and lp.grad[0, 2] == 0, ratio


@pytest.mark.parametrize("loss_fn", [icepop_loss, tis_loss, dppo_loss])
def test_kl_tau_adds_the_squared_log_ratio_on_every_loss_token(loss_fn):
    """prime-rl's KL term: kl_tau * (log pi_train - log pi_infer)^2 on every loss token, masked ones
    included; gradient 2 kl_tau log-ratio on each; a token outside the nucleus (-inf) adds nothing."""
    infer_lp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5]]))
    p = torch.tensor([[0.5, 0.9, 0.1, 0.3, 0.0]])  # ratios 1, 1.8, 0.2 (icepop masks it), 0.6 (no loss token), 0
    mask = torch.tensor([[True, True, True, False, True]])
    adv = torch.zeros(1, 5)  # the policy-gradient term contributes nothing: the KL term alone
    seq = torch.zeros(1, 5, dtype=torch.long)
    cfg = LossConfig(mask_low=0.5, mask_high=2.0, kl_tau=0.1)
    lp = p.log().requires_grad_()
    loss, _, m = loss_fn(lp, infer_lp, adv, mask, seq, cfg)
    log_ratio = (p.log() - infer_lp)[0, :3]
    torch.testing.assert_close(loss.detach(), 0.1 * log_ratio.square().sum())
    torch.testing.assert_close(m["kl_penalty"], log_ratio.square().sum())
    loss.backward()
    want = torch.zeros(1, 5)
    want[0, :3] = 2 * 0.1 * log_ratio
    torch.testing.assert_close(lp.grad, want)
    plain, _, m0 = loss_fn(p.log(), infer_lp, adv, mask, seq, LossConfig(mask_low=0.5, mask_high=2.0))
    assert plain.item() == 0 and "kl_penalty" not in m0


def test_kl_tau_must_not_be_negative():
    with pytest.raises(ValueError, match="kl_tau must be >= 0"):
        LossConfig(kl_tau=-1e-3)


def test_tis_stays_finite_on_a_token_outside_the_trainers_nucleus():
    """top_p < 1: a sampled token the trainer's nucleus excludes has logprob -inf (ratio 0). tis
    weighted exp(lp - lp.detach()) = exp(-inf + inf) = NaN there, which made the whole loss NaN."""
    lp = torch.log(torch.tensor([[0.5, 0.0]])).requires_grad_()
    loss, _, _ = tis_loss(lp, torch.log(torch.tensor([[0.5, 0.5]])), torch.tensor([[1.0, 1.0]]),
                          torch.tensor([[True, True]]), torch.zeros(1, 2, dtype=torch.long), LossConfig())
    loss.backward()
    assert loss.item() == -1.0 and lp.grad.tolist() == [[-1.0, 0.0]]


def test_dppo_masks_by_the_probabilitys_change_in_the_direction_of_the_advantage():
    """DPPO-Binary-TV (prime-rl 0.6.0's default): a token is masked when the trainer already moved its
    probability past the bound in the direction its advantage pushes; a large ratio on a rare token is not
    a large move, and a move against the advantage's push is left to the gradient."""
    cfg = LossConfig(kind="dppo", dppo_mask_low=0.2, dppo_mask_high=0.2)
    infer_p = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.001, 0.5, 0.5]])
    train_p = torch.tensor([[0.8, 0.8, 0.2, 0.2, 0.004, 0.9, 0.1]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, 0.0, 1.0]])
    mask = torch.tensor([[True, True, True, True, True, True, False]])
    lp = train_p.log().requires_grad_()
    loss, kept, m = dppo_loss(lp, infer_p.log(), adv, mask, torch.zeros(1, 7, dtype=torch.long), cfg)
    # +0.3 with A > 0: masked high; +0.3 with A < 0: kept; -0.3 with A < 0: masked low; -0.3 with A > 0:
    # kept; ratio 4 but +0.003: kept (icepop's [0.5, 2] masks it); A = 0: kept; not a loss token.
    assert kept.tolist() == [[False, True, False, True, True, True, False]]
    assert m["masked_high"].item() == 1 and m["masked_low"].item() == 1 and m["masked_tokens"].item() == 2
    _, icepop_kept, _ = icepop_loss(train_p.log(), infer_p.log(), adv, mask, torch.zeros(1, 7, dtype=torch.long),
                                    LossConfig())
    assert not icepop_kept[0, 4]
    loss.backward()  # -ratio * A on the kept tokens, untruncated
    ratio = train_p / infer_p
    want = torch.where(kept, -ratio * adv, torch.zeros_like(adv))
    torch.testing.assert_close(lp.grad, want)
    torch.testing.assert_close(loss.detach(), (want * kept).sum())


@pytest.mark.parametrize("kwargs, needle", [
    ({"kind": "dppo", "dppo_mask_high": 0.0}, "dppo_mask_high must be in (0, 1]"),
    ({"kind": "dppo", "dppo_mask_low": 1.5}, "dppo_mask_low must be in (0, 1]"),
    ({"dppo_mask_high": 0.3}, "has no effect with kind = icepop"),
    ({"kind": "dppo", "mask_high": 3.0}, "set dppo_mask_low / dppo_mask_high"),
])
def test_dppo_settings_that_would_do_nothing_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        LossConfig(**kwargs)


def test_the_loss_kinds_are_the_built_ins_or_an_import_path():
    from rlcli.config.train import BUILTIN_LOSSES
    from rlcli.train.loss import LOSSES, resolve_loss

    assert BUILTIN_LOSSES == tuple(LOSSES)  # the config's list (no torch there) and the functions agree
    assert resolve_loss("dppo") is dppo_loss
    with pytest.raises(ValueError, match="train.loss.kind 'ppo' is not a loss: use icepop, tis, dppo or "
                                         "package.module:function"):
        LossConfig(kind="ppo")
    assert LossConfig(kind="mine:loss", dppo_mask_high=0.3).dppo_mask_high == 0.3  # a loss of your own may read it
