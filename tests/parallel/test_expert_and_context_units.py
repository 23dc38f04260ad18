"""Single-process pieces of EP and CP: grouped GEMM, token permutations, batch sharding."""

import pytest
import torch

from rlcli.errors import ConfigError
from rlcli.models import ModelArgs, build_model
from rlcli.ops.grouped_gemm import grouped_mm, grouped_mm_loop
from rlcli.parallel.context import check_cp, cp_query_index, next_token_targets, rank_tokens, shard_batch_for_cp
from rlcli.parallel.expert import expert_load_metrics, source_major_to_expert_major


@pytest.mark.parametrize("n, k", [(8, 12), (10, 12)])  # kernel-aligned rows, and the loop fallback
def test_grouped_mm_matches_per_expert_loop_forward_and_backward(n, k):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1, 0, 7])  # empty experts included
    x = torch.randn(int(counts.sum()), k, generator=g, requires_grad=True)
    w = torch.randn(len(counts), n, k, generator=g, requires_grad=True)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    dy = torch.randn(x.shape[0], n, generator=g)
    out = grouped_mm(x, w, offs)
    out.backward(dy)
    grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    expected = torch.cat([x[s:e] @ w[i].T for i, (s, e) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
    expected.backward(dy)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], w.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grouped_mm_loop(x, w, offs), expected)


def test_source_major_to_expert_major_permutation():
    counts_SE = torch.tensor([[2, 0, 1], [1, 3, 0], [0, 2, 2]])  # from 3 source ranks to 3 local experts
    # Rows as received: source-major, each row labelled (source, expert).
    labels = [(s, e) for s in range(3) for e in range(3) for _ in range(int(counts_SE[s, e]))]
    order = source_major_to_expert_major(counts_SE, len(labels))
    permuted = [labels[i] for i in order.tolist()]
    assert permuted == sorted(labels, key=lambda se: (se[1], se[0]))
    assert sorted(order.tolist()) == list(range(len(labels)))


def _moe_model():
    hf = dict(model_type="qwen3_moe", vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=6,
              num_experts_per_tok=2, norm_topk_prob=True)
    model = build_model(ModelArgs.from_hf(hf))
    model.init_weights(seed=1, std=0.3)
    return model


def test_moe_grouped_path_matches_per_expert_loop():
    """The grouped experts compute what the former Python loop over experts computed."""
    moe = _moe_model().model.layers[0].mlp
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 32, generator=g)
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(20)])
    gates = torch.rand(20, 2, generator=g)
    ex = moe.experts
    expected = torch.zeros_like(x)
    for n in range(20):
        for j in range(2):
            e = idx[n, j]
            h = torch.nn.functional.silu(x[n] @ ex.w_gate[e].T) * (x[n] @ ex.w_up[e].T)
            expected[n] += gates[n, j] * (h @ ex.w_down[e].T)
    torch.testing.assert_close(moe.routed(x, idx, gates), expected, atol=1e-5, rtol=1e-5)
    assert moe.num_tokens_per_expert.tolist() == torch.bincount(idx.flatten(), minlength=6).tolist()


def test_expert_load_metrics_and_reset():
    model = _moe_model()
    moe = model.model.layers[0].mlp
    moe.num_tokens_per_expert = torch.tensor([4, 0, 2, 2, 2, 2])
    metrics = expert_load_metrics(model)
    assert float(metrics["moe_max_over_mean"]) == pytest.approx(2.0)
    counts = torch.tensor([4, 0, 2, 2, 2, 2.0])
    assert float(metrics["moe_cv"]) == pytest.approx(float(counts.std(unbiased=False) / counts.mean()))
    assert moe.num_tokens_per_expert is None and expert_load_metrics(model) == {}


def test_expert_counts_move_with_the_model_and_stay_out_of_its_state():
    """Counts from a forward on one device, then ``model.to(other)``: the next forward adds to
    counts on the new device (a CUDA test once failed here after a CPU forward)."""
    model = _moe_model()
    moe = model.model.layers[0].mlp
    moe.num_tokens_per_expert = torch.tensor([4, 0, 2, 2, 2, 2])
    model.to("meta")
    assert moe.num_tokens_per_expert.is_meta
    assert not any(k.endswith("num_tokens_per_expert") for k in model.state_dict())


def test_trainer_reports_expert_load_of_its_step_and_nothing_for_a_dense_model():
    from types import SimpleNamespace

    from rlcli.train.trainer import Trainer

    model = _moe_model()
    model.model.layers[0].mlp.num_tokens_per_expert = torch.tensor([4, 0, 2, 2, 2, 2])
    load = Trainer._expert_load(SimpleNamespace(model=model, dims=SimpleNamespace(enabled=False)))
    assert set(load) == {"moe_max_over_mean", "moe_max_over_mean_worst", "moe_cv", "moe_cv_worst"}
    assert float(load["moe_max_over_mean"]) == pytest.approx(2.0)
    dense = build_model(ModelArgs.from_hf(dict(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=48,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=8)))
    assert Trainer._expert_load(SimpleNamespace(model=dense, dims=None)) == {}


@pytest.mark.parametrize("T, cp", [(13, 2), (16, 2), (17, 4), (8, 4), (1000, 3)])
def test_rank_tokens_is_the_length_of_each_cp_shard(T, cp):
    """The bound rl-train's FP8 warm-up sweeps to under CP (rlcli.ops.fp8.warmup): each rank's GEMMs see M =
    its shard's tokens, never more."""
    t = {"input_ids": torch.arange(T)[None], "position_ids": torch.arange(T)[None]}
    for r in range(cp):
        local, _ = shard_batch_for_cp(t, r, cp)
        assert local["input_ids"].shape[1] == rank_tokens(T, cp)
    assert rank_tokens(T, 1) == T


def test_cp_shards_cover_the_padded_row_with_causal_load_balance():
    T, cp = 13, 2
    pos = torch.cat([torch.arange(6), torch.arange(7)])[None]
    t = next_token_targets({"input_ids": torch.arange(100, 100 + T)[None], "position_ids": pos, "temperature": 0.7,
                            "loss_mask": (pos > 1), "advantages": torch.ones(1, T),
                            "routed_experts": torch.arange(T * 2).view(T, 1, 2)})
    assert t["targets"][0, :-1].tolist() == list(range(101, 100 + T)) and t["loss_mask"][0, -1].item() is False
    assert cp_query_index(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    shards = [shard_batch_for_cp(t, r, cp) for r in range(cp)]
    seen = torch.cat([cp_query_index(16, r, cp) for r in range(cp)])
    assert sorted(seen.tolist()) == list(range(16))  # padded to 2 * cp * 4
    for r, (local, attn) in enumerate(shards):
        idx = cp_query_index(16, r, cp)
        real = idx < T
        assert local["input_ids"][0, real].tolist() == (100 + idx[real]).tolist()
        assert local["position_ids"].shape == (1, 8) and attn.num_keys == 16
        assert not local["loss_mask"][0, ~real].any()
        assert local["routed_experts"].shape == (8, 1, 2) and local["temperature"] == 0.7
        assert local["routed_experts"][real].flatten().tolist() == t["routed_experts"][idx[real]].flatten().tolist()


def test_cp_larger_than_the_row_names_the_flag():
    with pytest.raises(ConfigError, match="--cp 8"):
        check_cp(8, 10)
    with pytest.raises(ConfigError, match="--cp"):
        shard_batch_for_cp({"input_ids": torch.zeros(1, 5, dtype=torch.long),
                            "position_ids": torch.arange(5)[None]}, 0, 4)


def test_apply_ep_refuses_a_dense_model_and_keeps_a_one_rank_moe_exact():
    import torch.distributed as dist

    from rlcli.parallel.expert import apply_ep

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        dense = build_model(ModelArgs.from_hf(dict(model_type="llama", vocab_size=50, hidden_size=32,
                                                   intermediate_size=48, num_hidden_layers=1,
                                                   num_attention_heads=4, num_key_value_heads=2)))
        with pytest.raises(ConfigError, match="--ep 1 needs a mixture-of-experts model"):
            apply_ep(dense, dist.group.WORLD)
        model = _moe_model()
        ids = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(4))
        expected = model(ids)
        apply_ep(model, dist.group.WORLD)
        experts = model.model.layers[0].mlp.experts
        assert type(experts.w_gate).__name__ == "DTensor" and experts.w_gate.shape == (6, 16, 32)
        out = model(ids)
        torch.testing.assert_close(out, expected)
        # Dispatch and combine permute rows both ways by gathers: no backward accumulates into zeros
        # (autograd's backward of x[index] is an index_put with accumulate: atomic adds on CUDA).
        nodes = _autograd_nodes(out)
        assert "_PermuteBackward" in nodes and not nodes & {"IndexBackward0", "IndexAddBackward0"}, nodes
    finally:
        dist.destroy_process_group()


def _autograd_nodes(t: torch.Tensor) -> set[str]:
    """The names of every node in ``t``'s backward graph."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(fn.name())
        todo += [f for f, _ in fn.next_functions]
    return names
