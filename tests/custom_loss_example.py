"""A loss of a user's own for the tests (``train.loss.kind = "custom_loss_example:halved_icepop"``)."""

from rlcli.train.loss import icepop_loss

CALLS = []


def halved_icepop(trainer_lp, infer_lp, advantages, mask, seq_ids, cfg):
    """IcePop at half the weight; records each call's loss-token count."""
    CALLS.append(int(mask.sum()))
    loss, kept, metrics = icepop_loss(trainer_lp, infer_lp, advantages, mask, seq_ids, cfg)
    return loss / 2, kept, metrics


NOT_CALLABLE = 3
