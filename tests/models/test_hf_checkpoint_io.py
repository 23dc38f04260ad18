"""Checkpoint I/O: transformers -> rlcli -> transformers is lossless; bad checkpoints fail clearly."""

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from zoo import ARCHS, random_ids

from rlcli.errors import ModelLoadError
from rlcli.models import load_model, load_weights, save_model
from rlcli.models.safetensors_io import INDEX_NAME, SINGLE_NAME
from rlcli.models.tokenizer import load_tokenizer


def _assert_same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shard", [False, True], ids=["single", "sharded"])
@torch.no_grad()
def test_round_trip_through_transformers(arch, shard, hf_model_dir, tmp_path):
    src, ref = hf_model_dir(arch)
    ours = load_model(src)
    save_model(ours, tmp_path, source_dir=src, max_shard_bytes=40_000 if shard else 5 << 30)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if shard:
        assert len(shards) > 1 and (tmp_path / INDEX_NAME).is_file()
        weight_map = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
        assert sorted(set(weight_map.values())) == shards
    else:
        assert shards == [SINGLE_NAME] and not (tmp_path / INDEX_NAME).exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _assert_same_tensors(ref, back)
    ids = random_ids(ref.config.vocab_size, 2, 9, seed=11)
    assert torch.equal(ref(ids).logits, back(ids).logits)
    # And our own reader gets back the model it wrote.
    again = load_model(tmp_path)
    assert torch.equal(ours(ids), again(ids))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@torch.no_grad()
def test_load_weights_in_place(arch, hf_model_dir, tmp_path):
    """A weight update copies into the existing parameters (no new storage), e.g. a new policy."""
    src, ref = hf_model_dir(arch)
    model = load_model(src)
    other = load_model(src)
    for p in other.parameters():
        p.mul_(0.5)
    save_model(other, tmp_path)
    ptrs = [p.data_ptr() for p in model.parameters()]
    load_weights(model, tmp_path)
    assert ptrs == [p.data_ptr() for p in model.parameters()]
    ids = random_ids(ref.config.vocab_size, 1, 8, seed=12)
    assert torch.equal(model(ids), other(ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_save_in_lower_precision(dtype, hf_model_dir, tmp_path):
    src, _ = hf_model_dir("deepseek_v3")
    ours = load_model(src)
    save_model(ours, tmp_path, dtype=dtype)
    tensors = load_file(tmp_path / SINGLE_NAME)
    bias = [k for k in tensors if k.endswith("e_score_correction_bias")]
    assert bias and all(tensors[k].dtype == torch.float32 for k in bias)  # routing bias stays fp32
    assert all(t.dtype == dtype for k, t in tensors.items() if k not in bias)
    loaded = load_model(tmp_path, dtype=dtype)
    assert next(loaded.parameters()).dtype == dtype


# ------------------------------------------------------------------------------ errors


def _copy(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(path, name):
    tensors = load_file(path / SINGLE_NAME)
    assert name in tensors
    del tensors[name]
    save_file(tensors, path / SINGLE_NAME, metadata={"format": "pt"})


def test_missing_tensor_is_named(hf_model_dir, tmp_path):
    d = _copy(hf_model_dir("llama_bias")[0], tmp_path / "m")
    _drop_tensor(d, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(d)


def test_missing_expert_is_named(hf_model_dir, tmp_path):
    d = _copy(hf_model_dir("qwen3_moe")[0], tmp_path / "m")
    _drop_tensor(d, "model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(d)


def test_missing_tensor_in_weight_update_is_named(hf_model_dir, tmp_path):
    src = hf_model_dir("llama")[0]
    model = load_model(src)
    d = _copy(src, tmp_path / "m")
    _drop_tensor(d, "model.norm.weight")
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.norm\.weight"):
        load_weights(model, d)


@pytest.mark.parametrize("arch,field,value", [
    ("llama", "intermediate_size", 80),
    ("qwen3_moe", "moe_intermediate_size", 16),
    ("deepseek_v3", "kv_lora_rank", 8),
])
def test_shape_mismatch_names_tensor_and_shapes(arch, field, value, hf_model_dir, tmp_path):
    d = _copy(hf_model_dir(arch)[0], tmp_path / "m")
    _edit_config(d, **{field: value})
    with pytest.raises(ModelLoadError, match=r"tensor model\.layers\.\d+\.\S+ has shape \[[\d, ]+\], "
                                             r"config\.json implies \[[\d, ]+\]"):
        load_model(d)


def test_unknown_model_type_is_named(hf_model_dir, tmp_path):
    d = _copy(hf_model_dir("llama")[0], tmp_path / "m")
    _edit_config(d, model_type="gpt_neox")
    with pytest.raises(ModelLoadError, match=r"unknown model_type 'gpt_neox'.*supported: .*llama"):
        load_model(d)


@pytest.mark.parametrize("arch,field", [("llama", "hidden_size"), ("deepseek_v3", "kv_lora_rank"),
                                        ("qwen3_moe", "moe_intermediate_size")])
def test_missing_config_field_is_named(arch, field, hf_model_dir, tmp_path):
    d = _copy(hf_model_dir(arch)[0], tmp_path / "m")
    _edit_config(d, **{field: None})
    with pytest.raises(ModelLoadError, match=rf"missing field '{field}'"):
        load_model(d)


def test_missing_model_dir_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"does-not-exist does not exist; check model\.path"):
        load_model(tmp_path / "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_model(tmp_path / "empty")


def test_unexpected_tensor_is_named(hf_model_dir, tmp_path):
    d = _copy(hf_model_dir("qwen3")[0], tmp_path / "m")
    tensors = load_file(d / SINGLE_NAME)
    tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, d / SINGLE_NAME, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"unexpected tensor model\.layers\.0\.self_attn\.extra_proj\.weight"):
        load_model(d)


def test_missing_tokenizer_is_an_error(hf_model_dir, tmp_path):
    d = _copy(hf_model_dir("llama")[0], tmp_path / "m")
    with pytest.raises(ModelLoadError, match=r"has no tokenizer\.json"):
        load_tokenizer(d)


def test_moe_config_without_moe_tensors(hf_model_dir, tmp_path):
    """A dense checkpoint under an MoE config fails on the first expert tensor it lacks."""
    d = _copy(hf_model_dir("qwen3_moe")[0], tmp_path / "m")
    tensors = {k: v for k, v in load_file(d / SINGLE_NAME).items() if ".experts." not in k}
    save_file(tensors, d / SINGLE_NAME, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.0\.mlp\.experts\.0\.(gate|up|down)_proj"):
        load_model(d)
