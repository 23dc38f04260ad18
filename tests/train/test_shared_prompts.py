"""Shared-prompt packing is exact: every completion token's logprob, the loss and every gradient
equal unshared packing (fp32, up to reduction order), dense, MoE (with R3 replay) and DSA sparse
attention (MoE too), several groups per row and several rows, the loss normalized by the step's
token count."""

import msgspec
import numpy as np
import pytest
import torch

from rlcli.protocol.batch import TrainingBatch, build_micro_batch, decode_batch, encode_batch, prompt_units
from rlcli.train.loss import LOSSES
from rlcli.train.step import forward_backward, prepare
from tests.train.shared_prompts import CONFIGS, LCFG, make_model, make_samples, micro_batches, train_step


def _completion_logprobs(model, mb, r3: bool, device: str = "cpu") -> torch.Tensor:
    """The trainer's logprob of every loss token of a row, in row order."""
    seen = []

    def capture(lp, infer, adv, mask, seq_ids, cfg):
        seen.append(lp.detach()[mask])
        return LOSSES["icepop"](lp, infer, adv, mask, seq_ids, cfg)

    forward_backward(model, prepare(mb, torch.device(device)), torch.tensor(1.0, device=device), capture, LCFG, 5,
                     r3=r3)
    model.zero_grad(set_to_none=True)
    return seen[0]


@pytest.mark.parametrize("name", ["dense", "moe", "dsa"])
def test_shared_packing_matches_unshared(name):
    r3 = name != "dense"
    model = make_model(CONFIGS[name], seed=1)
    samples = make_samples(model, seed=2, r3=r3)

    # One row each way, same sample order: the completion tokens line up one to one.
    one = {share: build_micro_batch(samples, 1.0, share_prompts=share) for share in (False, True)}
    assert one[True].segment_ids is not None and one[False].segment_ids is None
    assert len(one[True].input_ids.numpy()) < len(one[False].input_ids.numpy())
    lp_u, lp_s = (_completion_logprobs(model, one[s], r3) for s in (False, True))
    assert lp_u.numel() == sum(len(s.token_ids) - s.num_prompt_tokens for s in samples)
    torch.testing.assert_close(lp_s, lp_u, rtol=1e-5, atol=1e-5)

    # A step of several rows, several groups per row.
    rows = {share: micro_batches(samples, share, capacity=48)[0] for share in (False, True)}
    assert len(rows[True]) < len(rows[False])
    assert any(len({int(p) for p in mb.segment_parents.numpy() if p >= 0}) > 1 for mb in rows[True])
    (tot_u, n_u, g_u), (tot_s, n_s, g_s) = (train_step(model, rows[s], r3) for s in (False, True))
    assert n_u.item() == n_s.item() == lp_u.numel()
    for key in ("loss", "entropy", "kept_tokens", "masked_by_sequence", "mismatch_kl"):
        torch.testing.assert_close(tot_s[key], tot_u[key], rtol=1e-5, atol=1e-6)
    assert 0 < tot_u["masked_by_sequence"] < n_u  # the sequence mask took some completions, not all
    if r3:
        layers = len(model.args.moe_layers)
        torch.testing.assert_close(tot_s["router_pairs"], tot_u["router_pairs"] - layers * _shared(rows[True]))
    assert g_s.keys() == g_u.keys()
    for k, g in g_u.items():
        assert g.abs().sum() > 0, k
        torch.testing.assert_close(g_s[k], g, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: DSA's Triton indexer and sparse attention")
def test_dsa_shared_rows_match_unshared_on_the_triton_kernels():
    model = make_model(CONFIGS["dsa"], seed=1)
    samples = make_samples(model, seed=2, r3=True)
    model.cuda()
    one = {share: build_micro_batch(samples, 1.0, share_prompts=share) for share in (False, True)}
    lp_u, lp_s = (_completion_logprobs(model, one[s], True, "cuda") for s in (False, True))
    assert lp_u.numel() == sum(len(s.token_ids) - s.num_prompt_tokens for s in samples)
    torch.testing.assert_close(lp_s, lp_u, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["dense", "moe", "dsa"])
def test_groups_whose_prompts_begin_alike_share_that_beginning(name):
    """Three groups whose prompts start with the same 5 tokens (a system message): those once, as
    the parent of each group's own prompt segment, and still exact."""
    r3 = name != "dense"
    model = make_model(CONFIGS[name], seed=1)
    samples = make_samples(model, seed=6, prompts=(9, 7, 12), group_sizes=(3, 2, 4), r3=r3, common=5)
    one = {share: build_micro_batch(samples, 1.0, share_prompts=share) for share in (False, True)}
    tree = one[True].tree()
    assert tree.spans[0] == (0, 5) and tree.parents[0] == -1 and tree.parents.count(0) == 3
    assert tree.num_unshared_tokens() == len(one[False].input_ids.numpy())
    assert len(one[True].input_ids.numpy()) == sum(len(s.token_ids) for s in samples) - (8 * 2 + 6 + 11 * 3) - 5 * 2
    lp_u, lp_s = (_completion_logprobs(model, one[s], r3) for s in (False, True))
    torch.testing.assert_close(lp_s, lp_u, rtol=1e-5, atol=1e-5)
    (tot_u, n_u, g_u), (tot_s, n_s, g_s) = (train_step(model, [one[s]], r3) for s in (False, True))
    for key in ("loss", "entropy", "mismatch_kl"):
        torch.testing.assert_close(tot_s[key], tot_u[key], rtol=1e-5, atol=1e-6)
    for k, g in g_u.items():
        torch.testing.assert_close(g_s[k], g, rtol=1e-4, atol=1e-6, msg=k)
    # Routes that differ inside the common part end it there.
    if r3:
        r = samples[3].routed_experts.numpy().copy()
        r[2] = (r[2] + 1) % model.args.num_experts
        for s in samples[3:5]:
            s.routed_experts = type(s.routed_experts).from_numpy(r)
        assert build_micro_batch(samples, 1.0, share_prompts=True).tree().spans[0] == (0, 2)


def _shared(shared_rows) -> float:
    """Tokens the shared rows do not repeat: each shared prompt token once, not once per completion."""
    n = 0
    for mb in shared_rows:
        tree = mb.tree()
        for j, (s, e) in enumerate(tree.spans):
            n += (e - s) * max(tree.parents.count(j) - 1, 0)
    return float(n)


def test_a_group_longer_than_a_row_is_cut():
    model = make_model(CONFIGS["dense"], seed=1)
    samples = make_samples(model, seed=5, prompts=(20,), group_sizes=(6,))
    units = prompt_units(samples, capacity=36)
    assert [n for n, _ in units] == [19] * len(units) and len(units) > 1
    assert sorted(i for _, idx in units for i in idx) == list(range(6))
    rows = micro_batches(samples, True, capacity=36)[0]
    assert all(len(mb.input_ids.numpy()) <= 36 for mb in rows)
    (tot_u, _, g_u), (tot_s, _, g_s) = (train_step(model, micro_batches(samples, s, 36)[0]) for s in (False, True))
    torch.testing.assert_close(tot_s["loss"], tot_u["loss"], rtol=1e-5, atol=1e-6)


def test_groups_with_different_prompt_routes_are_not_shared():
    model = make_model(CONFIGS["moe"], seed=1)
    samples = make_samples(model, seed=3, prompts=(6,), group_sizes=(3,), r3=True)
    r = samples[0].routed_experts.numpy().copy()
    r[2, 0] = (r[2, 0] + 1) % 6  # the engine routed a prompt token differently for this completion
    samples[0].routed_experts = type(samples[0].routed_experts).from_numpy(r)
    mb = build_micro_batch(samples, 1.0, share_prompts=True)
    assert mb.tree().parents == [-1, -1, 1, 1]  # sample 0 alone; samples 1 and 2 share
    lp_u = _completion_logprobs(model, build_micro_batch(samples, 1.0), True)
    torch.testing.assert_close(_completion_logprobs(model, mb, True), lp_u, rtol=1e-5, atol=1e-5)


def test_batches_without_segments_still_read():
    """A batch file written before shared packing (no segment fields) decodes and trains as before."""
    model = make_model(CONFIGS["dense"], seed=1)
    samples = make_samples(model, seed=4, prompts=(5, 6), group_sizes=(2, 2))
    mb = build_micro_batch(samples, 1.0)
    old = TrainingBatch(step=1, rank=0, micro_batches=[mb], num_loss_tokens=1, num_samples=4, min_version=0,
                        max_version=0)
    raw = msgspec.msgpack.decode(encode_batch(old))
    for row in raw["micro_batches"]:  # as written before the segment fields existed
        del row["segment_ids"], row["segment_parents"]
    back = decode_batch(msgspec.msgpack.encode(raw)).micro_batches[0]
    assert back.segment_ids is None and back.tree().parents == [-1] * 4
    np.testing.assert_array_equal(back.tree().segment_ids(), np.repeat(np.arange(4),
                                  [len(s.token_ids) for s in samples]))
