"""A model built in bf16 keeps the buffers that must stay fp32 (``fp32_buffers``): the rotary
frequencies and the MoE routing bias."""

from pathlib import Path

import torch

from rlcli.models import ModelArgs, build_model, load_model

REPO_MODELS = Path(__file__).resolve().parents[2] / "recipes" / "models"


def test_a_bf16_model_rotates_by_the_fp32_angles_at_long_positions():
    """bf16 frequencies are up to 2^-9 off: by position 100k that is radians of angle."""
    tables = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(REPO_MODELS / "tiny-llama", dtype=dtype, seed=0)
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
        pos = torch.tensor([[0, 1, 4095, 65_537, 131_071]])
        tables[dtype] = model.model.rotary_emb(pos, dtype)
    for fp32, bf16 in zip(tables[torch.float32], tables[torch.bfloat16]):
        assert torch.equal(fp32.to(torch.bfloat16), bf16)


def test_a_bf16_moe_keeps_its_routing_bias_fp32():
    model = build_model(ModelArgs.from_dir(REPO_MODELS / "dsv3-1.7b-random"), device="meta", dtype=torch.bfloat16,
                        materialize=False)
    biases = [m.e_score_correction_bias for m in model.modules() if getattr(m, "e_score_correction_bias", None)
              is not None]
    assert biases and {b.dtype for b in biases} == {torch.float32}
    assert model.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.bfloat16
