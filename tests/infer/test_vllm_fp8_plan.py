"""What the vLLM engine holds in block FP8 (rlcli.infer.vllm_fp8), without vLLM: the selection, the
quantization config vLLM starts with, its refusals, and the load stream every weight update passes."""

import json
from pathlib import Path

import pytest
import torch

from rlcli.config import load_recipe
from rlcli.errors import ConfigError, ModelLoadError
from rlcli.infer.vllm_fp8 import load_stream, plan
from rlcli.models.config import ModelArgs
from rlcli.models.fp8_io import QUANTIZATION_CONFIG, SCALE_SUFFIX
from rlcli.ops.fp8.quant import FP8_DTYPE, dequantize_128x128, quantize_128x128

REPO = Path(__file__).resolve().parents[2]


def checkpoint(tmp_path: Path, base: str, **over) -> Path:
    cfg = json.loads((REPO / f"recipes/models/{base}/config.json").read_text())
    cfg.update(over)
    d = tmp_path / base
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def llama(tmp_path):
    return checkpoint(tmp_path, "tiny-llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32)


def moe(tmp_path):
    return checkpoint(tmp_path, "tiny-qwen3-moe", hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=64)


def fp8_plan(path: Path, **over):
    cfg = load_recipe(None, {"infer.engine.name": "vllm", "infer.fp8.enabled": True, **over})
    return plan(cfg, path, ModelArgs.from_dir(path))


def test_without_fp8_a_bf16_checkpoint_has_no_plan(tmp_path):
    path = llama(tmp_path)
    assert plan(load_recipe(None, {}), path, ModelArgs.from_dir(path)) is None


def test_a_dense_model_holds_every_selected_linear_in_fp8_and_ignores_the_rest(tmp_path):
    p = fp8_plan(llama(tmp_path), **{"infer.fp8.exclude": ["*embed_tokens", "lm_head", "model.layers.1.mlp.down_proj"]})
    projs = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert p.names == projs - {"model.layers.1.mlp.down_proj.weight"}
    q = p.quantization_config
    assert {k: q[k] for k in QUANTIZATION_CONFIG} == QUANTIZATION_CONFIG
    assert "model.layers.1.mlp.down_proj" in q["ignored_layers"] and "model.embed_tokens" in q["ignored_layers"]
    assert not any(name + ".weight" in p.names for name in q["ignored_layers"])


def test_moe_experts_are_fp8_per_expert_and_the_router_is_ignored(tmp_path):
    p = fp8_plan(moe(tmp_path))
    experts = {n for n in p.names if ".mlp.experts." in n}
    assert len(experts) == 2 * 8 * 3  # layers x experts x (gate, up, down)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in experts
    assert "model.layers.0.mlp.gate" in p.quantization_config["ignored_layers"]
    assert not any(".mlp.gate.weight" in n for n in p.names)
    p = fp8_plan(moe(tmp_path), **{"infer.fp8.exclude": ["*embed_tokens", "lm_head", "*.mlp.gate", "*.experts"]})
    assert not any(".mlp.experts." in n for n in p.names)
    assert "model.layers.1.mlp.experts" in p.quantization_config["ignored_layers"]


@pytest.mark.parametrize("over, match", [
    ({"infer.fp8.ue8m0": True}, "infer.fp8.ue8m0"),
    ({"infer.fp8.include": ["nothing.*"]}, "selects no linear"),
    ({"infer.fp8.exclude": []}, "LM head"),
    ({"infer.fp8.exclude": ["*embed_tokens", "lm_head", "*.k_proj"]}, "include or exclude them together"),
])
def test_settings_vllm_cannot_serve_are_refused_in_one_line(tmp_path, over, match):
    with pytest.raises(ConfigError, match=match) as e:
        fp8_plan(llama(tmp_path), **over)
    assert "\n" not in str(e.value)


def test_a_merged_gemm_needs_whole_blocks_before_its_last_member(tmp_path):
    path = checkpoint(tmp_path, "tiny-llama", hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=64)  # k_proj: 64 outputs
    with pytest.raises(ConfigError, match="k_proj's 64 outputs"):
        fp8_plan(path)
    assert fp8_plan(path, **{"infer.fp8.exclude": ["*embed_tokens", "lm_head", "*.self_attn.[qkv]_proj"]})


def test_an_fp8_checkpoint_is_served_as_it_is(tmp_path):
    from safetensors.torch import save_file

    path = llama(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANTIZATION_CONFIG}))
    q, s = quantize_128x128(torch.randn(256, 256))
    save_file({"model.layers.0.self_attn.o_proj.weight": q, f"model.layers.0.self_attn.o_proj.weight{SCALE_SUFFIX}": s,
               "model.norm.weight": torch.ones(256)}, str(path / "model.safetensors"))
    p = plan(load_recipe(None, {}), path, ModelArgs.from_dir(path))  # FP8 whatever infer.fp8 says
    assert p.names == {"model.layers.0.self_attn.o_proj.weight"} and p.quantization_config is None


def test_the_load_stream_quantizes_passes_and_dequantizes():
    torch.manual_seed(0)
    w, held_bf16, norm = torch.randn(256, 384), torch.randn(128, 256), torch.randn(256)
    q, s = quantize_128x128(held_bf16)
    names = {"a.weight", "b.weight"}
    qb, sb = quantize_128x128(torch.randn(256, 256))
    out = dict(load_stream([("a.weight", w.to(torch.bfloat16)), ("b.weight", qb), ("b.weight" + SCALE_SUFFIX, sb),
                            ("c.weight" + SCALE_SUFFIX, s), ("c.weight", q), ("norm.weight", norm)],
                           names, torch.bfloat16))
    qa, sa = quantize_128x128(w.to(torch.bfloat16))  # what the trainer's FP8 publisher writes
    assert out["a.weight"].dtype == FP8_DTYPE and torch.equal(out["a.weight"].view(torch.uint8), qa.view(torch.uint8))
    assert torch.equal(out["a.weight" + SCALE_SUFFIX], sa)
    assert out["b.weight"] is qb and out["b.weight" + SCALE_SUFFIX] is sb  # FP8 already: as it came
    assert "c.weight" + SCALE_SUFFIX not in out  # held in high precision: dequantized
    assert torch.equal(out["c.weight"], dequantize_128x128(q, s, torch.bfloat16))
    assert out["norm.weight"] is norm


def test_an_fp8_weight_without_its_scale_is_refused():
    q, _ = quantize_128x128(torch.randn(128, 128))
    with pytest.raises(ModelLoadError, match="no c.weight_scale_inv"):
        list(load_stream([("c.weight", q)], set(), torch.bfloat16))


def test_tensor_parallel_shards_must_be_whole_blocks(tmp_path):
    path = llama(tmp_path)  # k/v_proj: 4 heads x 32 = 128 outputs, 64 per worker at tp 2
    with pytest.raises(ConfigError, match="shard of model.layers.0.self_attn.k_proj has 64 outputs"):
        fp8_plan(path, **{"infer.engine.tensor_parallel_size": 2})
    wide = checkpoint(tmp_path / "wide", "tiny-llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=32)
    assert fp8_plan(wide, **{"infer.engine.tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="o_proj has 64 inputs"):
        fp8_plan(wide, **{"infer.engine.tensor_parallel_size": 4,
                          "infer.fp8.exclude": ["*embed_tokens", "lm_head", "*.self_attn.[qkv]_proj"]})
    few_kv = checkpoint(tmp_path / "few", "tiny-llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=128)  # k/v replicated at tp 2
    assert fp8_plan(few_kv, **{"infer.engine.tensor_parallel_size": 2})
    experts = moe(tmp_path)  # 128 intermediate rows per expert
    with pytest.raises(ConfigError, match="experts has 64 intermediate rows"):
        fp8_plan(experts, **{"infer.engine.tensor_parallel_size": 2, "infer.fp8.exclude":
                             ["*embed_tokens", "lm_head", "*.mlp.gate", "*self_attn*"]})
    assert fp8_plan(experts, **{"infer.engine.tensor_parallel_size": 2, "infer.engine.expert_parallel": True,
                                "infer.fp8.exclude": ["*embed_tokens", "lm_head", "*.mlp.gate", "*self_attn*"]})
