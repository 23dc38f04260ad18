"""Each rank reads only the slices of an HF safetensors checkpoint it owns.

After ``parallelize`` a parameter is a DTensor; its local shard covers a box of the global
tensor (``compute_local_shape_and_global_offset``). That box is read with safetensors'
``get_slice`` (only those bytes are read), converted to the parameter's dtype and copied
into the local shard. Stacked experts ``[E, ...]`` map to per-expert HF tensors: a rank
reads just the experts in its box. Plain tensors (no parallelism, buffers) are read whole.
The model must be materialized (``to_empty``) first; nothing is ever gathered.
"""

from pathlib import Path

import torch
from safetensors import safe_open

from rlcli.errors import ModelLoadError
from rlcli.models.hf_io import _UNSTACKED
from rlcli.models.safetensors_io import weight_files


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

    def read(self, name: str, shape: tuple[int, ...], offset: tuple[int, ...], expect: list[int]) -> torch.Tensor:
        path = self.where.get(name)
        if path is None:
            raise ModelLoadError(f"{self.source}: missing tensor {name}")
        if path not in self.files:
            self.files[path] = safe_open(str(path), framework="pt")
        sl = self.files[path].get_slice(name)
        if list(sl.get_shape()) != list(expect):
            raise ModelLoadError(f"{self.source}: tensor {name} has shape {list(sl.get_shape())}, "
                                 f"config.json implies {list(expect)}")
        if not shape:
            return sl[:]
        return sl[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


@torch.no_grad()
def load_sharded(model: torch.nn.Module, source: str | Path) -> None:
    """Fill ``model``'s (possibly sharded) parameters and persistent buffers from ``source``."""
    reader = _Reader(Path(source))
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
