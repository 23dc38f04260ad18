"""FP8 checkpoints in DeepSeek-V3's layout: read (dequantize or keep) and write.

A DeepSeek-V3 / Kimi-K2 checkpoint says ``"quantization_config": {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}`` in config.json and stores each quantized linear as
``X.weight`` (float8_e4m3fn, [N, K]) plus ``X.weight_scale_inv`` (fp32,
[ceil(N/128), ceil(K/128)]); the weight is ``fp8 * weight_scale_inv`` block by block,
exactly :func:`rlcli.ops.fp8.quant.dequantize_128x128`. Tensors a model holds in FP8
(``FP8Linear`` with FP8 storage) load as they are; everything else is dequantized on the
fly, in the checkpoint's streaming order (a weight waits for its scale or vice versa).
Writing FP8 quantizes every ``FP8Linear``'s master weight with the same function the
trainer's forward uses, so an engine that keeps the FP8 weights computes the trainer's
forward exactly.
"""

from typing import Callable, Iterable, Iterator

import torch

from rlcli.errors import ModelLoadError
from rlcli.ops.fp8.quant import BLOCK, FP8_DTYPE, check_fp8_weight, dequantize_128x128, quantize_128x128

SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}


def is_fp8_checkpoint(hf: dict, source: str) -> bool:
    """Whether config.json declares block-FP8 weights; other quantization schemes are refused."""
    q = hf.get("quantization_config")
    if not q:
        return False
    if q.get("quant_method") != "fp8":
        raise ModelLoadError(f"{source}: quantization_config.quant_method {q.get('quant_method')!r} is not "
                             "supported (only DeepSeek-style block 'fp8')")
    block = list(q.get("weight_block_size") or [])
    if block != [BLOCK, BLOCK]:
        raise ModelLoadError(f"{source}: fp8 weight_block_size {block} is not supported (only [128, 128])")
    return True


def _dequantize(name: str, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, source: str) -> torch.Tensor:
    try:
        check_fp8_weight(q, s, name)
    except ValueError as e:
        raise ModelLoadError(f"{source}: {e}") from None
    return dequantize_128x128(q, s, dtype)


def dequantize_stream(tensors: Iterable[tuple[str, torch.Tensor]], source: str, dtype: torch.dtype,
                      keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pair every FP8 ``X.weight`` with ``X.weight_scale_inv`` and yield the weight dequantized to
    ``dtype``; names for which ``keep(name)`` is true pass through untouched (FP8 data and scales)."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if name.endswith(".weight" + SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if keep(name):
                yield name, t
            elif base in weights:
                yield base, _dequantize(base, weights.pop(base), t, dtype, source)
            else:
                scales[base] = t
        elif t.dtype == FP8_DTYPE and not keep(name):
            if name in scales:
                yield name, _dequantize(name, t, scales.pop(name), dtype, source)
            else:
                weights[name] = t
        else:
            yield name, t
    if weights:
        name = min(weights)
        raise ModelLoadError(f"{source}: {name} is float8 but the checkpoint has no {name}{SCALE_SUFFIX}")
    if scales:
        name = min(scales)
        raise ModelLoadError(f"{source}: {name}{SCALE_SUFFIX} has no float8 weight {name}")


def quantize_for_save(tensors: dict[str, torch.Tensor], fp8_names: Iterable[str]) -> dict[str, torch.Tensor]:
    """``tensors`` with every weight in ``fp8_names`` (HF names) as FP8 + ``weight_scale_inv``."""
    out = dict(tensors)
    for name in fp8_names:
        t = out[name]
        if t.dtype != FP8_DTYPE:
            out[name], out[name + SCALE_SUFFIX] = quantize_128x128(t.detach())
    return out
