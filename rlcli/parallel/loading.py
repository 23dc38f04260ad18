"""Each rank reads only the slices of an HF safetensors checkpoint it owns.

After ``parallelize`` a parameter is a DTensor; its local shard covers a box of the global
tensor (``compute_local_shape_and_global_offset``). That box is read with safetensors'
``get_slice`` (only those bytes are read), converted to the parameter's dtype and copied
into the local shard. Stacked experts ``[E, ...]`` map to per-expert HF tensors: a rank
reads just the experts in its box. Plain tensors (no parallelism, buffers) are read whole.
The model must be materialized (``to_empty``) first; nothing is ever gathered.

FP8 checkpoints (DeepSeek-V3 / Kimi-K2: float8 ``X.weight`` with fp32 ``X.weight_scale_inv`` per
128x128 block, :mod:`rlcli.models.fp8_io`) are dequantized box by box: a rank reads the block
scales covering its box and multiplies, the values :func:`rlcli.models.hf_io.load_model` gives.
As there, a tensor the model has no place for is refused by name.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from rlcli.errors import ModelLoadError
from rlcli.models.fp8_io import SCALE_SUFFIX, is_fp8_checkpoint
from rlcli.models.hf_io import _UNSTACKED, _ignorable, hf_entries
from rlcli.models.safetensors_io import weight_files
from rlcli.ops.fp8.quant import BLOCK, ceil_div


def _index(source: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it."""
    out: dict[str, Path] = {}
    for path in weight_files(source):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: path for name in f.keys()})
    return out


def _box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor to fill, local shape, global offset) of a parameter or buffer."""
    if hasattr(t, "device_mesh") and hasattr(t, "placements"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(shape), tuple(offset)
    return t, tuple(t.shape), (0,) * t.dim()


class _Reader:
    def __init__(self, source: Path):
        self.source = source
        self.where = _index(source)
        self.files: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.where

    def _slice(self, name: str):
        path = self.where.get(name)
        if path is None:
            raise ModelLoadError(f"{self.source}: missing tensor {name}")
        if path not in self.files:
            self.files[path] = safe_open(str(path), framework="pt")
        return self.files[path].get_slice(name)

    def read(self, name: str, shape: tuple[int, ...], offset: tuple[int, ...], expect: list[int]) -> torch.Tensor:
        sl = self._slice(name)
        if list(sl.get_shape()) != list(expect):
            raise ModelLoadError(f"{self.source}: tensor {name} has shape {list(sl.get_shape())}, "
                                 f"config.json implies {list(expect)}")
        if not shape:
            return sl[:]
        box = sl[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        if sl.get_dtype().startswith("F8"):
            return self._dequantized(name, box, offset, expect)
        return box

    def _dequantized(self, name: str, box: torch.Tensor, offset: tuple[int, ...], expect: list[int]) -> torch.Tensor:
        """An FP8 box times the block scales over it (``dequantize_128x128`` of the whole tensor, then cut)."""
        scale = name + SCALE_SUFFIX
        if len(expect) != 2:
            raise ModelLoadError(f"{self.source}: {name} is float8 but not a matrix ({list(expect)})")
        if scale not in self.where:
            raise ModelLoadError(f"{self.source}: {name} is float8 but the checkpoint has no {scale}")
        sl = self._slice(scale)
        want = [ceil_div(expect[0], BLOCK), ceil_div(expect[1], BLOCK)]
        if list(sl.get_shape()) != want:
            raise ModelLoadError(f"{self.source}: {scale} has shape {list(sl.get_shape())}, 128x128 blocks of "
                                 f"{list(expect)} need {want}")
        (r, c), (n, k) = offset, box.shape
        s = sl[r // BLOCK:ceil_div(r + n, BLOCK), c // BLOCK:ceil_div(c + k, BLOCK)].float()
        s = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[r % BLOCK:r % BLOCK + n, c % BLOCK:c % BLOCK + k]
        return box.float() * s

    def unused(self, model: torch.nn.Module) -> list[str]:
        """Checkpoint tensors no parameter or buffer of ``model`` reads (names the model has but this
        rank holds no slice of, scales of the weights read, and what load_model also ignores, aside)."""
        names = {n for _, _, hf in hf_entries(model) for n in hf}
        names |= {n + SCALE_SUFFIX for n in names}
        tied = model.args.tie_word_embeddings
        return sorted(n for n in self.where if n not in names and not _ignorable(n, model.args)
                      and not (tied and n == "lm_head.weight"))


@torch.no_grad()
def load_sharded(model: torch.nn.Module, source: str | Path) -> None:
    """Fill ``model``'s (possibly sharded) parameters and persistent buffers from ``source``; FP8
    weights are dequantized (module docstring). Raises ModelLoadError naming the first tensor that
    is missing, mis-shaped, or unexpected for the model."""
    source = Path(source)
    if (source / "config.json").exists():
        is_fp8_checkpoint(json.loads((source / "config.json").read_text()), str(source))  # refuses other schemes
    reader = _Reader(source)
    unexpected = reader.unused(model)
    if unexpected:
        raise ModelLoadError(f"{source}: unexpected tensor {unexpected[0]} for model_type {model.args.model_type}")
    tied = model.args.tie_word_embeddings
    targets = dict(model.named_parameters())
    targets.update({k: v for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")})
    for name, t in targets.items():
        if tied and name == "lm_head.weight":
            continue
        local, shape, offset = _box(t)
        if local.numel() == 0:
            continue
        prefix, _, leaf = name.rpartition(".")
        if leaf in _UNSTACKED and prefix.endswith("mlp.experts"):
            for i in range(shape[0]):
                e = offset[0] + i
                hf = f"{prefix}.{e}.{_UNSTACKED[leaf]}.weight"
                local[i].copy_(reader.read(hf, shape[1:], offset[1:], list(t.shape[1:])))
            continue
        local.copy_(reader.read(name, shape, offset, list(t.shape)))
