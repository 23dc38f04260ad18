"""R3 routing: record the experts each token used, replay them in another forward pass."""

import pytest
import torch
from zoo import MOE_ARCHS, make_caches, max_abs_diff, paged_step, random_ids, scattered_blocks

from rlcli.models import load_model
from rlcli.ops.attention import ForwardContext, PackedCausalAttention, RoutingContext


def _forward(model, ids, positions, routing):
    return model(ids, positions, ForwardContext(attn=PackedCausalAttention(positions), routing=routing))


@pytest.fixture(scope="module")
def moe_model(hf_model_dir):
    return lambda arch: load_model(hf_model_dir(arch)[0])


@torch.no_grad()
def _recorded(model):
    """(ids, positions, logits, routes [N, num_moe_layers, top_k]) of a recording forward of two packed rows."""
    ids = random_ids(model.args.vocab_size, 2, 13, seed=21)
    positions = torch.cat([torch.arange(6), torch.arange(7)]).expand(2, 13)
    record = RoutingContext(record=True)
    logits = _forward(model, ids, positions, record)
    return ids, positions, logits, record.stacked()


@pytest.mark.parametrize("arch", MOE_ARCHS)
@torch.no_grad()
def test_recorded_routes_shape_and_range(arch, moe_model):
    model = moe_model(arch)
    ids, positions, logits, routes = _recorded(model)
    args = model.args
    assert routes.shape == (ids.numel(), args.num_moe_layers, args.num_experts_per_tok)
    assert args.num_moe_layers == sum(hasattr(layer.mlp, "gate") for layer in model.model.layers)
    assert routes.min() >= 0 and routes.max() < args.num_experts
    assert all(len(set(r)) == len(r) for r in routes.reshape(-1, args.num_experts_per_tok).tolist())
    # Recording does not change the computation.
    assert torch.equal(logits, model(ids, positions))


@pytest.mark.parametrize("arch", MOE_ARCHS)
@torch.no_grad()
def test_replaying_recorded_routes_reproduces_logits(arch, moe_model):
    model = moe_model(arch)
    ids, positions, logits, routes = _recorded(model)
    replayed = _forward(model, ids, positions, RoutingContext(replay=routes))
    assert torch.equal(logits, replayed)


@pytest.mark.parametrize("arch", MOE_ARCHS)
@torch.no_grad()
def test_replaying_other_routes_changes_logits(arch, moe_model):
    model = moe_model(arch)
    ids, positions, logits, routes = _recorded(model)
    other = (routes + 1) % model.args.num_experts  # still k distinct experts per token
    shifted = _forward(model, ids, positions, RoutingContext(replay=other))
    assert max_abs_diff(logits, shifted) > 1e-3


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_gradients_reach_router_under_replay(arch, moe_model):
    """Replayed ids fix which experts run; the gate values still come from the router's scores."""
    model = moe_model(arch)
    ids, positions, _, routes = _recorded(model)
    model.zero_grad()
    logits = _forward(model, ids, positions, RoutingContext(replay=routes))
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(routers) == model.args.num_moe_layers
    for router in routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("arch", MOE_ARCHS)
@torch.no_grad()
def test_routes_recorded_by_paged_inference_replay_in_training_forward(arch, moe_model):
    """The R3 flow: the engine records routes over a prefill and decode steps; the trainer's
    packed forward replays them and computes the engine's logits."""
    model = moe_model(arch)
    seq = random_ids(model.args.vocab_size, 12, seed=22)
    caches, table = make_caches(model), scattered_blocks(6, 3)
    steps, routes = [], []
    for chunk, start, num_decode in [(seq[:9], 0, 0), (seq[9:10], 9, 1), (seq[10:11], 10, 1), (seq[11:], 11, 1)]:
        record = RoutingContext(record=True)
        steps.append(paged_step(model, caches, [(chunk, start, table)], num_decode=num_decode, routing=record))
        routes.append(record.stacked())
    engine_logits, engine_routes = torch.cat(steps), torch.cat(routes)
    assert engine_routes.shape == (12, model.args.num_moe_layers, model.args.num_experts_per_tok)
    trainer_logits = _forward(model, seq[None], torch.arange(12)[None], RoutingContext(replay=engine_routes))[0]
    assert max_abs_diff(trainer_logits, engine_logits) <= 1e-4


def test_dispatch_and_combine_match_the_indexed_formula_with_gradients():
    """The layer's dispatch and combine (gathers both ways, their own backward) give the output and
    the gradients of the plain formula: ``x[order // k]`` in, weighted ``index_add_`` out, in float64."""
    from rlcli.models.config import ModelArgs
    from rlcli.models.moe import MoE

    args = ModelArgs(model_type="qwen3_moe", vocab_size=1, hidden_size=16, intermediate_size=1, num_hidden_layers=1,
                     num_attention_heads=1, num_key_value_heads=1, head_dim=1, num_experts=6,
                     num_experts_per_tok=3, moe_intermediate_size=8, norm_topk_prob=True, moe_layers=[0])
    torch.manual_seed(0)
    layer = MoE(args, 0).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    idx = layer.gate.select(layer.gate.scores(x.detach()))
    dy = torch.randn(37, 16, dtype=torch.float64)

    def reference():
        N, k = idx.shape
        order = idx.reshape(-1).argsort(stable=True)
        counts = torch.bincount(idx.reshape(-1), minlength=6)
        gates = layer.gate.gates(layer.gate.scores(x), idx, x.dtype)
        y = layer.experts(x[order // k], counts) * gates.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, order // k, y)

    outs = []
    for fn in (reference, lambda: layer.routed(x, idx, layer.gate.gates(layer.gate.scores(x), idx, x.dtype))):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = fn()
        y.backward(dy)
        outs.append((y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (y0, gx0, g0), (y1, gx1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx1, gx0, rtol=1e-12, atol=1e-12)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-12, atol=1e-12, msg=name)
