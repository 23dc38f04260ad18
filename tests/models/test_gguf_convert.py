"""GGUF -> HF conversion, on GGUF files written here the way llama.cpp writes them.

A tiny random Llama is written with llama.cpp's conventions (tensor names, the Q/K row
permutation, quantized blocks, tokenizer metadata) by the ``gguf`` package's writer, then
converted. Q and K are stored as F32, so the un-permutation must reproduce them exactly;
the converted model must equal what transformers reads from the same GGUF file.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from zoo import max_abs_diff, random_ids

from rlcli.errors import ModelLoadError
from rlcli.models import load_model
from rlcli.models.gguf import convert_gguf, find_packaged_gguf
from rlcli.models.hf_tokenizer import HFTokenizer

gguf = pytest.importorskip("gguf", reason="GGUF conversion needs the gguf package: pip install 'rlcli[gguf]'")
Q = gguf.GGMLQuantizationType

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = ["Reverse the word 'banana' and answer only with the reversed word.",
          "The year 2024 had 366 days; 7 * 8 = 56 and 12345 is a number.",
          "Hello, world! How are you today? I am fine, thank you."] * 30
# How llama.cpp stores each HF tensor: (GGUF name, storage type).
LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm.weight", Q.F32),
    "post_attention_layernorm.weight": ("ffn_norm.weight", Q.F32),
    "self_attn.q_proj.weight": ("attn_q.weight", Q.F32),
    "self_attn.k_proj.weight": ("attn_k.weight", Q.F32),
    "self_attn.v_proj.weight": ("attn_v.weight", Q.F16),
    "self_attn.o_proj.weight": ("attn_output.weight", Q.BF16),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q.Q4_1),
    "mlp.up_proj.weight": ("ffn_up.weight", Q.Q8_0),
    "mlp.down_proj.weight": ("ffn_down.weight", Q.Q5_1),
}


def _smollm_tokenizer() -> Tokenizer:
    """Byte-level BPE trained with SmolLM's pre-tokenizer (each digit alone, then GPT-2's split)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _store(writer, name: str, w: torch.Tensor, qtype) -> None:
    a = w.detach().float().numpy()
    if qtype == Q.F32:
        writer.add_tensor(name, a)
    elif qtype == Q.F16:
        writer.add_tensor(name, a.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def write_llama_gguf(path, tied: bool = True, arch: str = "llama", tokenizer_model: str = "gpt2",
                     pre: str = "smollm"):
    """A tiny random Llama as llama.cpp would write it; returns the HF model it came from."""
    tok = _smollm_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    # A digit merge the trainer never learns (it saw digits one by one): only the pre-tokenizer
    # keeps it from applying, so it shows whether the digit split survived conversion.
    tokens.append("12")
    merges.append("1 2")
    cfg = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_unk_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    state = hf.state_dict()
    _store(w, "token_embd.weight", state["model.embed_tokens.weight"], Q.Q8_0)
    _store(w, "output_norm.weight", state["model.norm.weight"], Q.F32)
    if not tied:
        _store(w, "output.weight", state["lm_head.weight"], Q.Q8_0)
    for i in range(cfg.num_hidden_layers):
        for hf_name, (gguf_name, qtype) in LAYER_TENSORS.items():
            t = state[f"model.layers.{i}.{hf_name}"]
            if "q_proj" in hf_name:
                t = torch.from_numpy(_llama_cpp_permute(t.numpy(), cfg.num_attention_heads))
            elif "k_proj" in hf_name:
                t = torch.from_numpy(_llama_cpp_permute(t.numpy(), cfg.num_key_value_heads))
            _store(w, f"blk.{i}.{gguf_name}", t, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def converted(request, tmp_path_factory):
    """(GGUF file, converted directory, the HF model the GGUF was written from)."""
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny.gguf"
    hf = write_llama_gguf(path, tied=request.param)
    return path, convert_gguf(path, root / "converted"), hf


def _transformers_from_gguf(path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def test_config_and_files(converted):
    path, out, hf = converted
    names = sorted(p.name for p in out.iterdir())
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert f in names
    cfg = json.loads((out / "config.json").read_text())
    ref = hf.config
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 10000.0
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["chat_template"]) == \
        ("<|im_start|>", "<|im_end|>", CHAT_TEMPLATE)


@torch.no_grad()
def test_unquantized_tensors_round_trip_exactly(converted):
    """Q/K were stored as F32 after llama.cpp's permutation: un-permuting must give them back bit for bit."""
    _, out, hf = converted
    ours = load_model(out).state_dict()
    ref = hf.state_dict()
    for i in range(hf.config.num_hidden_layers):
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "input_layernorm.weight"):
            key = f"model.layers.{i}.{name}"
            assert torch.equal(ours[key], ref[key]), key
    # Quantized ones are close (the quantization error), not garbled.
    for key in ("model.embed_tokens.weight", "model.layers.1.mlp.gate_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        assert max_abs_diff(ours[key], ref[key]) < 0.05, key


@torch.no_grad()
def test_matches_transformers_reading_the_gguf(converted):
    path, out, _ = converted
    ref = _transformers_from_gguf(path)
    ours = load_model(out).eval()
    ref_state, our_state = ref.state_dict(), ours.state_dict()
    assert ref_state.keys() == our_state.keys()
    for key in ref_state:
        assert torch.equal(ref_state[key], our_state[key]), key
    ids = random_ids(ref.config.vocab_size, 2, 15, seed=3)
    assert max_abs_diff(ours(ids), ref(ids).logits) <= 1e-4


def test_tokenizer_matches_transformers_reading_the_gguf(converted):
    path, out, _ = converted
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = HFTokenizer(out)
    assert ours.vocab_size == len(ref)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (ref.bos_token_id, [ref.eos_token_id],
                                                                         ref.pad_token_id)
    for text in ["Reverse the word 'banana'.", "  2024 had 366 days\n\n", "<|im_start|>user\nhi<|im_end|>", "naïve"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    messages = [{"role": "user", "content": "Reverse: banana"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, add_generation_prompt=True,
                                                                         return_dict=False)


def test_digits_are_split_one_by_one(converted):
    """llama.cpp's 'smollm' pre-tokenizer isolates every number character before BPE, so the
    vocabulary's "12" never applies (transformers' GGUF reader, which splits GPT-2 style, uses it)."""
    _, out, _ = converted
    ours = HFTokenizer(out)
    ids = ours.encode("x12345")
    assert [ours.decode([i]) for i in ids][-5:] == list("12345")
    assert ours.encode("12") != [ours.vocab_size - 1]


@pytest.mark.parametrize("pre", ["default", "llama-bpe"])
def test_other_pre_tokenizers_match_transformers(pre, tmp_path):
    """GPT-2's split (digits grouped) and Llama 3's (digits in threes): the "12" merge applies."""
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, pre=pre)
    ours = HFTokenizer(convert_gguf(path, tmp_path / "out"))
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["x12345 and 1234567", "  The year 2024!\n\n", "it's 12 o'clock, isn't it?"]:
        assert ours.encode(text) == ref.encode(text), text
    assert ours.vocab_size - 1 in ours.encode("12")


# ------------------------------------------------------------------------------ errors


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="is not a readable GGUF file"):
        convert_gguf(bad, tmp_path / "out")
    with pytest.raises(ModelLoadError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs,message", [
    (dict(arch="qwen2"), "GGUF architecture 'qwen2' is not supported"),
    (dict(tokenizer_model="llama"), "tokenizer model 'llama' is not supported"),
    (dict(pre="qwen2"), "pre-tokenizer 'qwen2' is not supported"),
])
def test_unsupported_file_is_refused_before_writing(kwargs, message, tmp_path):
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, **kwargs)
    with pytest.raises(ModelLoadError, match=message):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(converted, tmp_path):
    path, _, _ = converted
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="is not empty"):
        convert_gguf(path, out)
    convert_gguf(path, out, overwrite=True)
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()


def test_convert_command_reports_json(converted, tmp_path):
    path, _, _ = converted
    out = subprocess.run([Path(sys.executable).parent / "rl-train", "convert", str(path), str(tmp_path / "m"),
                          "--dtype", "bfloat16", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"gguf": str(path), "out": str(tmp_path / "m"), "dtype": "bfloat16"}
    assert load_model(tmp_path / "m", dtype=torch.bfloat16).args.vocab_size == load_model(path.parent / "converted"
                                                                                          ).args.vocab_size


def test_missing_gguf_package(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(ModelLoadError, match=r"pip install 'rlcli\[gguf\]'"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")


def test_find_packaged_gguf_errors():
    with pytest.raises(ModelLoadError, match="pip install --no-deps no-such-package-here"):
        find_packaged_gguf("no_such_package_here")
    with pytest.raises(ModelLoadError, match="contains no .gguf file"):
        find_packaged_gguf("json")
