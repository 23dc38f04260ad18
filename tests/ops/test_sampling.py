import pytest
import torch

from rlcli.ops import sampling
from rlcli.ops.sampling import _nucleus_by_sort, sample, top_p_keep


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
    # Past 2 x 1,024 tokens, a top-p batch of peaked rows reads one value: whether any row goes on.
    logits = torch.randn(4, 3 * sampling.NUCLEUS_CANDIDATES[0]) * 8

    class Reads(Ops):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.reads += func.overloadpacket.__name__ == "_local_scalar_dense"
            return func(*args, **(kwargs or {}))

    with Reads():
        sample(logits, torch.ones(4), torch.tensor([1.0, 0.9, 1.0, 1.0]), torch.Generator().manual_seed(0),
               any_top_p=True)
    assert Reads.reads == 1


def _rows_with_edges(V: int, edges: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Probability rows of a V-token vocabulary that test where each tier of candidates ends (``edges``):
    peaked and flat rows; per edge K, a row whose probabilities tie across the K-th place and a row whose
    nucleus at 0.99 ends on a tie at the K-th place; rows of one token, of all tokens equal, and of eight
    equal tokens."""
    rows = [torch.softmax(torch.randn(V, generator=g) * s, -1) for s in (12.0, 7.0, 4.0, 2.0, 0.5)]
    for K in edges:
        tie = torch.full((V,), 1e-9)
        tie[torch.randperm(V, generator=g)[: 3 * K // 2]] = 1.0  # 1.5K equal tokens: the top-k picks some
        rows.append(tie / tie.sum())
        edge = torch.full((V,), 1e-12)
        order = torch.randperm(V, generator=g)
        edge[order[: K - 4]] = torch.linspace(2.0, 1.5, K - 4)
        edge[order[K - 4: K + 40 + K // 32]] = min(1.0, 0.01 * (K - 4))  # the nucleus at 0.99 ends among these
        rows.append(edge / edge.sum())
    one = torch.zeros(V)
    one[int(torch.randint(V, (1,), generator=g))] = 1.0
    few = torch.full((V,), 1e-12)
    few[torch.randperm(V, generator=g)[:8]] = 1.0  # a nucleus that ends inside ties, well above any edge
    rows += [one, torch.full((V,), 1.0 / V), few / few.sum()]
    return torch.stack(rows)


@pytest.mark.parametrize("tiers, V", [((16, 128), 384), (sampling.NUCLEUS_CANDIDATES, 40_000)])
def test_the_nucleus_from_the_candidates_is_the_whole_sorts(monkeypatch, tiers, V):
    """top_p_keep looks for a row's nucleus among its most likely tokens, tier by tier, before sorting the
    row: its mask equals the whole sort's, to the bit, for peaked, flat, tied and one-token rows, rows that
    stop at each tier and rows that go on to the whole sort, per-row and scalar top-p, 2-D and 3-D (the
    trainer's [B, T, V]) input."""
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", tiers)
    g = torch.Generator().manual_seed(0)
    probs = _rows_with_edges(V, tiers, g)
    R = probs.shape[0]
    for top_p in (0.5, 0.9, 0.99, 0.999999, torch.rand(R, 1, generator=g) * 0.98 + 0.01):
        want = _nucleus_by_sort(probs, top_p)
        assert torch.equal(top_p_keep(probs, top_p), want)
        p3 = top_p.view(R // 4, 4, 1) if isinstance(top_p, torch.Tensor) else top_p
        assert torch.equal(top_p_keep(probs.view(R // 4, 4, -1), p3), want.view(R // 4, 4, -1))
    for i, K in enumerate(tiers):
        edge = probs[6 + 2 * i]
        tied = edge == edge.sort(descending=True).values[K]  # the nucleus at 0.99 ends inside these
        kept = _nucleus_by_sort(edge[None], 0.99)[0, tied]
        assert kept.any() and not kept.all()
    sizes = top_p_keep(probs, 0.9).sum(-1)
    assert sizes[0] < tiers[0] < sizes[4] and sizes[-3] == 1 and sizes[-1] == 8 and sizes[-2] > 2 * tiers[-1]
    assert top_p_keep(probs, 0.5).sum(-1)[-1] == 4  # the first four of the eight by token


def test_a_rows_nucleus_does_not_depend_on_its_batch():
    """The engine and the trainer batch tokens differently: a peaked row's mask is the same beside a flat
    row (which needs the whole sort) as alone."""
    g = torch.Generator().manual_seed(1)
    V = 3 * sampling.NUCLEUS_CANDIDATES[0]
    peaked, flat = torch.softmax(torch.randn(2, V, generator=g) * torch.tensor([[9.0], [0.3]]), -1)
    both = top_p_keep(torch.stack([peaked, flat]), 0.95)
    assert torch.equal(both[0], top_p_keep(peaked[None], 0.95)[0])
    assert torch.equal(both[1], top_p_keep(flat[None], 0.95)[0])
