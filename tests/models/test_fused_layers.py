"""The native engine's fused layers (rlcli.infer.fused_layers) on every architecture: the forward,
full and through the paged KV cache, equals the zoo's; the swap keeps every parameter where it was.

They run on CUDA; without it, tests/ops/test_fused_kernels.py runs this file under Triton's
interpreter on CPU tensors.
"""

import copy

import pytest
import torch
from zoo import ARCHS, make_caches, max_abs_diff, paged_step, random_ids, scattered_blocks

import interpreter
from rlcli.models import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu" if interpreter.ACTIVE else None
TOL = 1e-5  # fp32: the sums of squares in another order


@pytest.fixture(scope="module")
def models(hf_model_dir):
    if DEVICE is None:
        pytest.skip("needs CUDA; without it tests/ops/test_fused_kernels.py runs this under the interpreter")
    from rlcli.infer.fused_layers import kernels

    if kernels() is None:
        pytest.skip("triton does not import")
    return lambda arch: load_model(hf_model_dir(arch)[0]).to(DEVICE).eval()


def fused(model):
    from rlcli.infer.fused_layers import fuse_layers

    twin = copy.deepcopy(model)
    assert fuse_layers(twin) is None
    return twin


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_the_fused_forward_equals_the_zoos(arch, models):
    model = models(arch)
    twin = fused(model)
    assert any(type(m).__name__.startswith("Fused") for m in twin.modules())
    ids = random_ids(model.args.vocab_size, 2, 13, seed=3).to(DEVICE)
    assert max_abs_diff(twin(ids), model(ids)) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_fused_paged_decodes_equal_the_zoos(arch, models):
    """A prefill, then decodes through the paged cache, each against the unfused model's step."""
    model = models(arch)
    twin = fused(model)
    seq = random_ids(model.args.vocab_size, 12, seed=7).to(DEVICE)
    table = scattered_blocks(2, 4)
    caches = [make_caches(model), make_caches(model)]
    caches = [[tuple(c.to(DEVICE) for c in layer) for layer in cs] for cs in caches]
    diffs = [max_abs_diff(paged_step(twin, caches[0], [(seq[:9], 0, table)]),
                          paged_step(model, caches[1], [(seq[:9], 0, table)]))]
    for p in range(9, 12):
        diffs.append(max_abs_diff(paged_step(twin, caches[0], [(seq[p:p + 1], p, table)], num_decode=1),
                                  paged_step(model, caches[1], [(seq[p:p + 1], p, table)], num_decode=1)))
    assert max(diffs) <= TOL, diffs


def test_the_swap_keeps_parameters_and_falls_back_under_autograd(models):
    model = models("qwen3")
    twin = fused(model)
    params = {n: p for n, p in twin.named_parameters()}
    from rlcli.infer.fused_layers import fuse_layers

    assert fuse_layers(twin) is None  # idempotent
    assert {n: p for n, p in twin.named_parameters()} == params
    assert twin.state_dict().keys() == model.state_dict().keys()
    assert type(twin.model.layers[0].self_attn).__name__ == "FusedAttention"
    ids = random_ids(model.args.vocab_size, 1, 9, seed=4).to(DEVICE)
    with torch.enable_grad():  # the kernels have no backward: the module's own code, bit for bit
        assert torch.equal(twin(ids), model(ids))
