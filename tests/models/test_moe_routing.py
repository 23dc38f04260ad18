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
