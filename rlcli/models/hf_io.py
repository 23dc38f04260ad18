"""Build, load and save models in the Hugging Face layout.

``load_model`` builds on the meta device and assigns tensors viewed straight out of the
memory-mapped safetensors files (one copy at most: a dtype conversion or the stacking of
per-expert tensors). ``save_model`` writes the same layout back, sharded, with the
original ``config.json`` and tokenizer files, so transformers and vLLM read our weights.
"""

import importlib
import json
import re
import shutil
from pathlib import Path
from typing import Iterable

import torch

from rlcli.errors import ModelLoadError
from rlcli.models.config import ARCHITECTURES, ModelArgs
from rlcli.models.fp8_io import QUANTIZATION_CONFIG, SCALE_SUFFIX, dequantize_stream, is_fp8_checkpoint, quantize_for_save
from rlcli.models.safetensors_io import iter_tensors, save_sharded, weight_files
from rlcli.models.transformer import CausalLM
from rlcli.ops.fp8.quant import FP8_DTYPE, quantize_128x128

_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
_UNSTACKED = {v: k for k, v in _STACKED.items()}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_class(args: ModelArgs) -> type[CausalLM]:
    module = importlib.import_module(f"rlcli.models.{ARCHITECTURES[args.model_type]}")
    return next(v for v in vars(module).values()
                if isinstance(v, type) and issubclass(v, CausalLM) and v.__module__ == module.__name__)


def build_model(args: ModelArgs, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                materialize: bool = True) -> CausalLM:
    """The architecture of ``args`` on the meta device; materialized (uninitialized weights,
    computed buffers) on ``device`` unless ``materialize`` is False."""
    with torch.device("meta"):
        model = model_class(args)(args)
    model.to(dtype=dtype)
    for module in model.modules():  # buffers a module keeps fp32 whatever the model's dtype
        for name in getattr(module, "fp32_buffers", ()):
            if getattr(module, name, None) is not None:
                setattr(module, name, getattr(module, name).float())
    if materialize:
        model.to_empty(device=device)
        model.tie_weights()
        model.init_buffers()
    return model


def has_weights(model_dir: str | Path) -> bool:
    return bool(weight_files(model_dir))


def hf_entries(model: CausalLM, state: dict[str, torch.Tensor] | None = None
               ) -> list[tuple[str, torch.Tensor, list[str]]]:
    """(state-dict name, tensor, its HF names) per tensor the checkpoint holds, in order: a
    stacked expert weight ``[E, ...]`` stands for E per-expert HF tensors."""
    out = []
    tied = model.args.tie_word_embeddings
    for name, t in (model.state_dict() if state is None else state).items():
        if tied and name == "lm_head.weight":
            continue
        prefix, _, leaf = name.rpartition(".")
        if leaf in _UNSTACKED and prefix.endswith("mlp.experts"):
            out.append((name, t, [f"{prefix}.{e}.{_UNSTACKED[leaf]}.weight" for e in range(t.shape[0])]))
        else:
            out.append((name, t, [name]))
    return out


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under HF names (stacked experts split into per-expert views)."""
    out: dict[str, torch.Tensor] = {}
    for _, t, names in hf_entries(model):
        if len(names) == 1:
            out[names[0]] = t
        else:
            out.update({n: t[e] for e, n in enumerate(names)})
    return out


def _ignorable(name: str, args: ModelArgs) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = _LAYER_RE.match(name)  # DeepSeek multi-token-prediction layers sit past the last layer
    return bool(m and int(m.group(1)) >= args.num_hidden_layers)


def collect_state_dict(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Map HF-named tensors onto ``model``'s state dict (names, shapes, dtype), stacking experts.
    FP8 weights with ``weight_scale_inv`` are dequantized to ``dtype``, unless the model holds
    that weight in FP8 (then data and scales load as they are; a high-precision weight is
    quantized for it). Raises ModelLoadError naming the first missing or mis-shaped tensor."""
    expected = model.state_dict()
    args = model.args
    fp8_held = {n for n, t in expected.items() if t.dtype == FP8_DTYPE}
    tensors = dequantize_stream(tensors, source, dtype,
                                keep=lambda n: n in fp8_held or n[: -len(SCALE_SUFFIX)] in fp8_held)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    filled: dict[str, set[int]] = {}
    for name, t in tensors:
        m = _EXPERT_RE.match(name)
        if m:
            key = f"{m.group(1)}.{_STACKED[m.group(3)]}"
            if key not in expected:
                raise ModelLoadError(f"{source}: unexpected tensor {name} (layer is not MoE in config.json)")
            e = int(m.group(2))
            target = expected[key]
            if e >= target.shape[0] or list(t.shape) != list(target.shape[1:]):
                raise ModelLoadError(f"{source}: tensor {name} has shape {list(t.shape)}, "
                                     f"config.json implies {list(target.shape[1:])} for {target.shape[0]} experts")
            if key not in experts:
                experts[key] = torch.empty(target.shape, dtype=dtype)
            experts[key][e].copy_(t)
            filled.setdefault(key, set()).add(e)
            continue
        if name not in expected:
            if _ignorable(name, args) or (name == "lm_head.weight" and args.tie_word_embeddings):
                continue
            raise ModelLoadError(f"{source}: unexpected tensor {name} for model_type {args.model_type}")
        if list(t.shape) != list(expected[name].shape):
            raise ModelLoadError(f"{source}: tensor {name} has shape {list(t.shape)}, "
                                 f"config.json implies {list(expected[name].shape)}")
        if name in fp8_held and t.dtype != FP8_DTYPE:  # quantized from ``dtype``, as the trainer's master weight is
            out[name], out[name + SCALE_SUFFIX] = quantize_128x128(t.to(dtype))
            continue
        keep = name.endswith("e_score_correction_bias") or name in fp8_held or name.endswith(SCALE_SUFFIX)
        out[name] = t if (t.dtype == dtype or keep) else t.to(dtype)
    for key, got in filled.items():
        if len(got) != expected[key].shape[0]:
            missing = min(set(range(expected[key].shape[0])) - got)
            raise ModelLoadError(f"{source}: missing tensor {key.rsplit('.', 1)[0]}.{missing}."
                                 f"{_UNSTACKED[key.rsplit('.', 1)[1]]}.weight")
    out.update(experts)
    for name in expected:
        if name not in out and not (name == "lm_head.weight" and args.tie_word_embeddings):
            prefix, _, leaf = name.rpartition(".")
            if leaf in _UNSTACKED:  # name the first per-expert tensor the checkpoint should hold
                name = f"{prefix}.0.{_UNSTACKED[leaf]}.weight"
            raise ModelLoadError(f"{source}: missing tensor {name}")
    return out


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0, weights_dir: str | Path | None = None, fp8=None, fp8_storage: bool = False,
               checksums: dict[str, str] | None = None) -> CausalLM:
    """Load an HF-layout model. A directory with config.json but no safetensors gets random
    weights from ``seed`` (tiny models built from a config). ``weights_dir`` reads the tensors
    from another directory (a policy version) with the architecture of ``path``.

    FP8 checkpoints (``quantization_config.quant_method = "fp8"``) are dequantized to ``dtype``.
    With ``fp8`` (an enabled :class:`~rlcli.config.model.Fp8Config`) the selected linears become
    FP8 linears: on master weights in ``dtype`` (training), or with ``fp8_storage`` holding FP8
    weights + scales as the checkpoint has them (inference). ``checksums`` (file name -> checksum, from
    the directory's STABLE manifest) are checked on the mapped files before any tensor is used."""
    args = ModelArgs.from_dir(path)
    source = Path(weights_dir or path)
    is_fp8_checkpoint(args.hf, str(path))  # refuses quantization schemes we cannot read
    model = build_model(args, device="meta", dtype=dtype, materialize=False)
    fp8 = fp8 if fp8 is not None and fp8.enabled else None
    if fp8 is not None:
        from rlcli.ops.fp8.convert import convert_to_fp8

        convert_to_fp8(model, fp8, device, fp8_storage=fp8_storage)
    if not has_weights(source):
        if weights_dir is not None:
            raise ModelLoadError(f"{source} holds no safetensors files")
        if fp8 is not None and fp8_storage:  # random init needs master weights first
            model = build_model(args, device="meta", dtype=dtype, materialize=False)
        model.to_empty(device=device)
        model.tie_weights()
        model.init_buffers()
        model.init_weights(seed)
        if fp8 is not None and fp8_storage:
            convert_to_fp8(model, fp8, device, fp8_storage=True)
        return model
    state = collect_state_dict(model, iter_tensors(source, checksums), str(source), dtype)
    if torch.device(device).type != "cpu":
        state = {k: v.to(device) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    for name, buf in model.named_buffers():  # buffers not in the checkpoint (rotary tables)
        if buf.is_meta:
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            setattr(parent, name.rsplit(".", 1)[1], torch.empty_like(buf, device=device))
    model.init_buffers()
    return model


@torch.no_grad()
def load_weights(model: CausalLM, weights_dir: str | Path) -> None:
    """Copy a checkpoint's tensors into ``model``'s existing parameters (in-place weight update)."""
    params = model.state_dict()
    state = collect_state_dict(model, iter_tensors(weights_dir), str(weights_dir), next(model.parameters()).dtype)
    for name, t in state.items():
        params[name].copy_(t)


def save_model(model: CausalLM, out_dir: str | Path, source_dir: str | Path | None = None,
               max_shard_bytes: int = 5 << 30, dtype: torch.dtype | None = None, fp8: bool = False) -> None:
    """Write ``model`` as an HF-layout directory: safetensors shards (+ index), config.json,
    and the tokenizer / generation files found in ``source_dir``. With ``fp8`` (implied by FP8
    weights in the model) every FP8 linear is written as FP8 + ``weight_scale_inv`` and
    config.json declares DeepSeek-V3's ``quantization_config``; otherwise that key is dropped."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model)
    fp8_names = [f"{n}.weight" for n, m in model.named_modules() if hasattr(m, "to_fp8_storage")]
    fp8 = fp8 or any(t.dtype == FP8_DTYPE for t in tensors.values())
    if fp8:
        tensors = quantize_for_save(tensors, fp8_names)
    if dtype is not None:
        tensors = {k: (v if k.endswith(("e_score_correction_bias", SCALE_SUFFIX)) or v.dtype == FP8_DTYPE
                       else v.to(dtype)) for k, v in tensors.items()}
    save_sharded(tensors, out_dir, max_shard_bytes)
    hf = dict(model.args.hf)
    hf.pop("quantization_config", None)
    if fp8:
        hf["quantization_config"] = dict(QUANTIZATION_CONFIG)
    if dtype is not None:
        hf["torch_dtype" if "torch_dtype" in hf else "dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if source_dir is not None:
        copy_tokenizer_files(source_dir, out_dir)


def copy_tokenizer_files(source_dir: str | Path, out_dir: str | Path) -> None:
    for fname in TOKENIZER_FILES:
        src = Path(source_dir) / fname
        if src.is_file():
            shutil.copyfile(src, Path(out_dir) / fname)
