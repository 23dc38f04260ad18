"""FP8 checkpoints in DeepSeek-V3's layout (float8_e4m3fn weights + weight_scale_inv) load,
dequantized or kept FP8, and match their dequantized twin; FP8 saving round-trips."""

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from zoo import random_ids

from rlcli.errors import ModelLoadError
from rlcli.models import load_model, save_model
from rlcli.ops.fp8.linear import FP8Linear
from rlcli.ops.fp8.quant import FP8_DTYPE, dequantize_128x128, quantize_128x128

# Which tensors DeepSeek-V3 stores in FP8: every linear projection, experts included; not the
# embeddings, lm_head, router (mlp.gate) or norms.
_FP8_NAME = re.compile(r".*(_proj|_proj_with_mqa)\.weight$")
FP8_CFG = SimpleNamespace(enabled=True, backend="emulated", include=["*"],
                          exclude=["*embed_tokens", "lm_head", "*.mlp.gate"], ue8m0=False)


def _write_fp8_and_twin(src, fp8_dir, twin_dir, twin_dtype=torch.bfloat16):
    """From an HF model directory: an FP8 copy in DeepSeek-V3's layout and its dequantized twin."""
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    fp8, twin = {}, {}
    for name, t in tensors.items():
        if _FP8_NAME.match(name):
            q, s = quantize_128x128(t)
            assert s.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
            fp8[name], fp8[name + "_scale_inv"] = q, s
            twin[name] = dequantize_128x128(q, s, twin_dtype)
        else:
            fp8[name] = twin[name] = t
    hf = json.loads((src / "config.json").read_text())
    for d, ts, quant in ((fp8_dir, fp8, True), (twin_dir, twin, False)):
        d.mkdir(exist_ok=True)
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(hf, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}) if quant else hf
        (d / "config.json").write_text(json.dumps(cfg))
    return fp8


@pytest.fixture(scope="module")
def fp8_pair(hf_model_dir, tmp_path_factory):
    src, _ = hf_model_dir("deepseek_v3")
    root = tmp_path_factory.mktemp("fp8")
    tensors = _write_fp8_and_twin(src, root / "fp8", root / "twin")
    _write_fp8_and_twin(src, root / "fp8", root / "twin32", torch.float32)
    assert any(".experts." in n and n.endswith("_scale_inv") for n in tensors)
    return root / "fp8", root / "twin", tensors


def test_fp8_checkpoint_dequantizes_on_load_to_its_twin(fp8_pair):
    fp8_dir, twin_dir, _ = fp8_pair
    ids = random_ids(97, 2, 11)
    m8, mt = load_model(fp8_dir, dtype=torch.bfloat16), load_model(twin_dir, dtype=torch.bfloat16)
    for (n, a), (_, b) in zip(m8.state_dict().items(), mt.state_dict().items()):
        assert torch.equal(a, b), n
    with torch.no_grad():
        assert torch.equal(m8(ids), mt(ids))


def test_fp8_checkpoint_kept_fp8_matches_twin_through_fp8_linears(fp8_pair):
    fp8_dir, twin_dir, tensors = fp8_pair
    kept = load_model(fp8_dir, dtype=torch.float32, fp8=FP8_CFG, fp8_storage=True)
    q_proj = kept.get_submodule("model.layers.0.self_attn.q_b_proj")
    assert isinstance(q_proj, FP8Linear) and q_proj.weight.dtype == FP8_DTYPE
    name = "model.layers.0.self_attn.q_b_proj.weight"
    assert torch.equal(q_proj.weight.view(torch.uint8), tensors[name].view(torch.uint8))
    assert torch.equal(q_proj.weight_scale_inv, tensors[name + "_scale_inv"])
    # Master weights = the fp32 dequantized twin; quantizing it again gives back the same FP8 data
    # (scales within an ulp), so both models compute the same function.
    master = load_model(twin_dir.parent / "twin32", dtype=torch.float32, fp8=FP8_CFG)
    ids = random_ids(97, 2, 11)
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), master(ids), rtol=1e-4, atol=1e-4)


def test_fp8_save_round_trips_data_and_scales(fp8_pair, tmp_path):
    fp8_dir, _, _ = fp8_pair
    kept = load_model(fp8_dir, dtype=torch.float32, fp8=FP8_CFG, fp8_storage=True)
    save_model(kept, tmp_path / "out")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["quantization_config"]["weight_block_size"] == [128, 128]
    again = load_model(tmp_path / "out", dtype=torch.float32, fp8=FP8_CFG, fp8_storage=True)
    for (n, a), (_, b) in zip(kept.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == FP8_DTYPE else b), n
    plain = load_model(fp8_dir, dtype=torch.float32)
    save_model(plain, tmp_path / "plain")  # dequantized weights: the fp8 declaration must not survive
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_trainer_master_weights_publish_as_fp8(fp8_pair, tmp_path):
    """A model on master weights with FP8 linears writes FP8 + scales equal to its forward's quantization."""
    _, twin_dir, _ = fp8_pair
    master = load_model(twin_dir, dtype=torch.float32, fp8=FP8_CFG)
    save_model(master, tmp_path / "pub", fp8=True)
    out = load_file(tmp_path / "pub" / "model.safetensors")
    w = master.get_submodule("model.layers.1.mlp.shared_experts.down_proj").weight
    q, s = quantize_128x128(w)
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert torch.equal(out[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(out[name + "_scale_inv"], s)
    served = load_model(tmp_path / "pub", dtype=torch.float32, fp8=FP8_CFG, fp8_storage=True)
    ids = random_ids(97, 1, 9)
    with torch.no_grad():
        torch.testing.assert_close(served(ids), master(ids), rtol=1e-5, atol=1e-5)


def test_fp8_checkpoint_errors_name_the_tensor(fp8_pair, tmp_path):
    fp8_dir, _, tensors = fp8_pair
    bad = dict(tensors)
    name = "model.layers.0.self_attn.o_proj.weight"
    del bad[name + "_scale_inv"]
    d = tmp_path / "missing"
    shutil.copytree(fp8_dir, d)
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"{name} is float8 but the checkpoint has no {name}_scale_inv"):
        load_model(d)
    bad[name + "_scale_inv"] = torch.ones(3, 3)
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="weight_scale_inv has shape"):
        load_model(d)
    hf = json.loads((d / "config.json").read_text())
    hf["quantization_config"]["weight_block_size"] = [1, 128]
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ModelLoadError, match="weight_block_size"):
        load_model(d)


def _sharded_load(src):
    """rl-train's load (rlcli.parallel.loading.load_sharded) into a materialized model, unsharded."""
    from rlcli.models import ModelArgs, build_model
    from rlcli.parallel.loading import load_sharded

    model = build_model(ModelArgs.from_dir(src), device="meta", dtype=torch.float32, materialize=False)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_buffers()
    load_sharded(model, src)
    return model


def test_the_trainers_loader_dequantizes_an_fp8_checkpoint(fp8_pair):
    """rl-train from an FP8 base model (DeepSeek-V3 / Kimi-K2 releases): its sharded loader gives the
    weights load_model gives (float8 data times its block scales), experts included; it once copied
    the raw float8 values in (448 where the weight was 1e-2)."""
    fp8_dir, _, _ = fp8_pair
    want = load_model(fp8_dir, dtype=torch.float32).state_dict()
    got = _sharded_load(fp8_dir).state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("box", [((0, 0), (300, 260)), ((37, 0), (100, 260)), ((128, 129), (172, 131)),
                                 ((255, 5), (1, 1)), ((150, 200), (150, 60))])
def test_a_shards_box_is_dequantized_with_the_scales_over_it(tmp_path, box):
    """A rank's box of an FP8 weight (offsets off the 128 grid, boxes inside one block and across
    several, a ragged last block) equals the same box of the whole dequantized weight."""
    from rlcli.parallel.loading import _Reader

    (r, c), (n, k) = box
    w = torch.randn(300, 260) * torch.exp(torch.randn(300, 1))
    q, s = quantize_128x128(w)
    save_file({"w.weight": q, "w.weight_scale_inv": s}, str(tmp_path / "model.safetensors"))
    got = _Reader(tmp_path).read("w.weight", (n, k), (r, c), [300, 260])
    assert torch.equal(got, dequantize_128x128(q, s)[r:r + n, c:c + k])


def test_the_trainers_loader_names_what_it_cannot_place(fp8_pair, tmp_path):
    fp8_dir, _, tensors = fp8_pair
    name = "model.layers.0.self_attn.o_proj.weight"
    for edit, match in ((lambda t: t.pop(name + "_scale_inv"), f"{name} is float8 but the checkpoint has no "),
                        (lambda t: t.update({name + "_scale_inv": torch.ones(3, 3)}), "o_proj.weight_scale_inv has shape"),
                        (lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.ones(2)}),
                         "unexpected tensor model.layers.0.self_attn.extra.weight")):
        bad = dict(tensors)
        edit(bad)
        d = tmp_path / "bad"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(fp8_dir, d)
        save_file(bad, str(d / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=match):
            _sharded_load(d)
