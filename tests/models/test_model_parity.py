"""Our models compute what transformers computes, in fp32, for every architecture variant."""

import pytest
import torch
from zoo import ARCHS, max_abs_diff, random_ids

from rlcli.models import load_model

TOL = 1e-5


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_logits_match_transformers(arch, hf_model_dir):
    path, ref = hf_model_dir(arch)
    ours = load_model(path).eval()
    ids = random_ids(ref.config.vocab_size, 2, 19, seed=1)
    expected = ref(ids).logits
    got = ours(ids)
    assert got.shape == expected.shape
    diff = max_abs_diff(got, expected)
    assert diff <= TOL, f"{arch}: max |logits diff| {diff:.3g}"
    # The comparison means something only if logits are not tiny and differ across tokens.
    assert expected.abs().max() > 1.0 and expected.std() > 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
@torch.no_grad()
def test_perturbed_weight_breaks_parity(arch, hf_model_dir):
    """Sanity of the parity test itself: a small error in one tensor shows up above the tolerance."""
    path, ref = hf_model_dir(arch)
    ours = load_model(path).eval()
    ours.model.layers[-1].post_attention_layernorm.weight.add_(0.01)
    ids = random_ids(ref.config.vocab_size, 1, 11, seed=2)
    assert max_abs_diff(ours(ids), ref(ids).logits) > TOL


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_packed_sequences_equal_separate(arch, hf_model_dir):
    """Two sequences packed in one row (positions restart at 0) do not see each other."""
    path, _ = hf_model_dir(arch)
    model = load_model(path).eval()
    V = model.args.vocab_size
    a, b = random_ids(V, 1, 7, seed=3), random_ids(V, 1, 10, seed=4)
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(10)])[None]
    logits = model(packed, positions)
    diff_a = max_abs_diff(logits[:, :7], model(a))
    diff_b = max_abs_diff(logits[:, 7:], model(b))
    assert max(diff_a, diff_b) <= TOL, (diff_a, diff_b)
    # Without the position reset, b would attend to a: the check above is not vacuous.
    assert max_abs_diff(model(packed)[:, 7:], logits[:, 7:]) > TOL
