import torch

from rlcli.ops.sampling import sample


def test_greedy_rows_and_sampled_rows_in_one_batch():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    tokens, lps = sample(logits, torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]),
                         torch.Generator().manual_seed(0))
    assert tokens[0].item() == 1
    assert torch.allclose(lps[0], torch.log_softmax(logits[0], -1)[1])


def test_the_callers_greedy_hint_changes_nothing_but_the_work():
    """``greedy_rows="all"`` (every row at temperature 0) gives the argmax and its logprob, as without the
    hint, and draws nothing from the generator; ``"none"`` gives the same draws as without it."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(5))
    zero, one, top_p = torch.zeros(6), torch.ones(6), torch.tensor([1.0, 0.5, 1.0, 0.9, 1.0, 1.0])
    for p in (torch.ones(6), top_p):
        want = sample(logits, zero, p, torch.Generator().manual_seed(0))
        gen = torch.Generator().manual_seed(0)
        got = sample(logits, zero, p, gen, greedy_rows="all")
        assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])
        assert torch.equal(gen.get_state(), torch.Generator().manual_seed(0).get_state())
        want = sample(logits, one, p, torch.Generator().manual_seed(1))
        got = sample(logits, one, p, torch.Generator().manual_seed(1), greedy_rows="none")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4).contiguous()
    tokens, _ = sample(logits, torch.ones(20000), torch.ones(20000), torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(5000, 4).contiguous()
    tokens, lps = sample(logits, torch.ones(5000), torch.full((5000,), 0.75), torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75
    # logprobs are of the nucleus actually sampled from, renormalized
    assert torch.allclose(lps, (probs / 0.8).log()[tokens])


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(4000, 3).contiguous()
    cold, _ = sample(logits, torch.full((4000,), 0.25), torch.ones(4000), torch.Generator().manual_seed(0))
    hot, _ = sample(logits, torch.full((4000,), 4.0), torch.ones(4000), torch.Generator().manual_seed(0))
    assert (cold == 0).float().mean() > 0.95 > (hot == 0).float().mean()


def test_row_generators_make_rows_independent_of_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    temp, top_p = torch.ones(3), torch.ones(3)
    a, _ = sample(logits, temp, top_p, torch.Generator().manual_seed(1), {2: torch.Generator().manual_seed(9)})
    b, _ = sample(logits, temp, top_p, torch.Generator().manual_seed(2), {2: torch.Generator().manual_seed(9)})
    assert a[2] == b[2]


def test_sampling_never_reads_a_tensor_value_on_the_host():
    """The module's "no host sync" (the caller says whether any row uses top-p): no op that copies a
    tensor's value to Python (``.item()``, ``bool(t)``, ``.tolist()``: ``aten::_local_scalar_dense``)
    runs, with greedy, top-p and seeded rows mixed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    logits = torch.randn(4, 50)
    with Ops() as ops:
        sample(logits, torch.tensor([0.0, 1.0, 0.7, 1.0]), torch.tensor([1.0, 0.9, 1.0, 1.0]),
               torch.Generator().manual_seed(0), {3: torch.Generator().manual_seed(1)}, any_top_p=True)
    assert "_local_scalar_dense" not in ops.names
    assert "searchsorted" in ops.names  # the ops were seen
