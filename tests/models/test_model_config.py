"""config.json fields that change the function are read, or refused by name; stray safetensors
files beside a checkpoint are not read."""

import json

import pytest
import torch
from safetensors.torch import save_file
from zoo import max_abs_diff, random_ids

from rlcli.errors import ModelLoadError
from rlcli.models import ModelArgs, load_model
from rlcli.models.config import UnsupportedConfig

LLAMA = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2)
GLM4 = dict(LLAMA, model_type="glm4_moe", n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
            head_dim=8)
GLM5 = dict(LLAMA, model_type="glm_moe_dsa", num_hidden_layers=4, n_routed_experts=2, num_experts_per_tok=1,
            moe_intermediate_size=8, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8)


@pytest.mark.parametrize("hf, field", [
    (dict(LLAMA, hidden_act="gelu"), "hidden_act"),
    (dict(GLM4, hidden_act="relu"), "hidden_act"),
    (dict(LLAMA, partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
    (dict(GLM4, partial_rotary_factor=0.1), "partial_rotary_factor"),
    (dict(GLM5, indexer_types=["full", "shared", "dense", "full"]), "indexer_types"),
    (dict(GLM5, indexer_types=["shared", "full", "full", "full"]), "indexer_types"),
    (dict(GLM5, scoring_func="sqrtsoftplus"), "scoring_func"),
    (dict(GLM5, q_lora_rank=None), "q_lora_rank"),
])
def test_unsupported_values_are_refused_by_field(hf, field):
    with pytest.raises(UnsupportedConfig, match=field) as e:
        ModelArgs.from_hf(hf)
    assert isinstance(e.value, ValueError) and isinstance(e.value, ModelLoadError)


def test_function_changing_fields_are_read():
    glm4 = ModelArgs.from_hf(dict(GLM4, attention_bias=True, use_qk_norm=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert glm4.partial_rotary_factor == 0.5 and glm4.qk_norm and glm4.attention_bias and not glm4.o_proj_bias
    assert ModelArgs.from_hf(dict(GLM4, partial_rotary_factor=0.25)).partial_rotary_factor == 0.25
    glm5 = ModelArgs.from_hf(dict(GLM5, index_topk=16, index_topk_freq=2, index_skip_topk_offset=1))
    assert glm5.indexer_layers == [0, 2] and glm5.index_topk == 16 and glm5.index_rope_interleave
    v32 = ModelArgs.from_hf(dict(GLM5, model_type="deepseek_v32", mlp_layer_types=["dense", "sparse", "dense", "sparse"]))
    assert v32.indexer_layers == [0, 1, 2, 3] and v32.moe_layers == [1, 3] and not v32.index_rope_interleave


@torch.no_grad()
def test_stray_safetensors_files_are_not_read(hf_model_dir, tmp_path):
    src, _ = hf_model_dir("llama")
    ref = load_model(src).eval()
    ids = random_ids(97, 1, 9, seed=1)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    tensors = {k: v.clone() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:5]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[5:]} | {"stray.weight": torch.zeros(3)},
              str(d / "model-00002-of-00002.safetensors"))
    garbage = {k: torch.randn_like(v) for k, v in tensors.items()}
    save_file(garbage, str(d / "consolidated.safetensors"))  # an older export beside the shards
    save_file(garbage, str(d / "model.safetensors"))
    index = {"weight_map": {k: f"model-0000{1 if i < 5 else 2}-of-00002.safetensors" for i, k in enumerate(names)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert max_abs_diff(load_model(d)(ids), ref(ids)) == 0.0  # the index's files, not the strays
    (d / "model.safetensors.index.json").unlink()
    assert max_abs_diff(load_model(d)(ids), ref(ids)) > 0.1  # without the index: model.safetensors
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="consolidated.safetensors.*refusing to guess"):
        load_model(d)
