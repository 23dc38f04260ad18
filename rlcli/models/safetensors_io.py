"""Memory-mapped safetensors reading and sharded writing in the Hugging Face layout.

Reading maps each file privately (copy-on-write) and views tensors straight out of the
mapping: nothing is read until touched, and a parameter assigned from such a view costs
no second copy (``safetensors.safe_open`` copies each tensor out instead). Given the
checksum written with a file (``rlcli.transport.checksum``), opening it hashes the mapping:
that pass is the file's one read from storage (its pages stay resident for the tensors
viewed from them), and a corrupt file is refused before any tensor is used.

Writing: which tensor goes to which file is huggingface_hub's plan
(``split_state_dict_into_shards_factory``: in order, files of at most ``max_shard_bytes``,
named ``model-00001-of-0000N.safetensors``, or ``model.safetensors`` when one file is
enough), computed from byte counts alone. That is what lets every trainer rank write its
own files of one plan (``rlcli.train.publish``) with no rank holding the whole model;
``save_torch_state_dict`` would need every tensor in one process. Stacked MoE experts are
written as per-expert views of one tensor, which huggingface_hub's storage-id check would
take for shared tensors, so the plan is made from sizes, never from the tensors.
"""

import json
import mmap
import struct
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from rlcli.errors import ModelLoadError
from rlcli.transport.checksum import verify

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """One safetensors file, memory-mapped; ``tensor(name)`` views into the mapping. With
    ``expected`` (its checksum) the whole mapping is checked first (:class:`CorruptFile` on a mismatch)."""

    def __init__(self, path: str | Path, expected: str | None = None):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError, struct.error) as e:
            raise ModelLoadError(f"{self.path}: not a readable safetensors file ({e})") from None
        if expected is not None:
            verify(self.path, self._mmap, expected)
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries = header
        self._base = 8 + header_len

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> list[int]:
        return self.entries[name]["shape"]

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        shape = entry["shape"]
        if end == start:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8, count=end - start, offset=self._base + start)
        return flat.view(dtype).view(shape)


def _weight_map(model_dir: Path) -> dict[str, str] | None:
    index = model_dir / INDEX_NAME
    if not index.is_file():
        return None
    try:
        return json.loads(index.read_text()).get("weight_map", {})
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{index}: invalid JSON: {e}") from None


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of an HF-layout directory: those the index names when there is one,
    else ``model.safetensors``, else the only ``*.safetensors`` file. Other files beside them
    (an optimizer dump, an older export) are not read; without an index, several candidate
    files are refused by name rather than guessed at."""
    model_dir = Path(model_dir)
    weight_map = _weight_map(model_dir)
    if weight_map is not None:
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{model_dir / INDEX_NAME} lists {f.name}, which is missing")
        return files
    if (model_dir / SINGLE_NAME).is_file():
        return [model_dir / SINGLE_NAME]
    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ModelLoadError(f"{model_dir} has {len(files)} safetensors files ({names}) but no {SINGLE_NAME} and no "
                             f"{INDEX_NAME}; refusing to guess which hold the model: add the index or remove the others")
    return files


def iter_tensors(model_dir: str | Path, checksums: dict[str, str] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, mmap-backed tensor) for every tensor of the model directory; with an index, only the
    tensors it maps to each file (a stray tensor inside a listed shard is not read). ``checksums``
    (file name -> checksum) are checked as each file is opened."""
    weight_map = _weight_map(Path(model_dir))
    for path in weight_files(model_dir):
        f = SafetensorsFile(path, (checksums or {}).get(path.name))
        for name in f.keys():
            if weight_map is None or weight_map.get(name) == path.name:
                yield name, f.tensor(name)


def plan_shards(sizes: dict[str, int], max_shard_bytes: int = 5 << 30) -> dict[str, str]:
    """HF tensor name -> file name, from each tensor's size in bytes (huggingface_hub's split)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(sizes, get_storage_size=int, max_shard_size=max_shard_bytes,
                                                 filename_pattern=SINGLE_NAME.replace(".", "{suffix}.", 1))
    return dict(split.tensor_to_filename)


def write_index(out_dir: str | Path, weight_map: dict[str, str]) -> None:
    """``model.safetensors.index.json`` for files already written in ``out_dir``; total_size is
    the tensor bytes (the files' sizes less their headers), as transformers writes it."""
    out_dir = Path(out_dir)
    total = 0
    for fname in set(weight_map.values()):
        with open(out_dir / fname, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
        total += (out_dir / fname).stat().st_size - 8 - header_len
    (out_dir / INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def save_sharded(tensors: dict[str, torch.Tensor], out_dir: str | Path, max_shard_bytes: int = 5 << 30) -> list[str]:
    """Write ``tensors`` (names in HF layout) as one or more safetensors shards (+ index when
    there are several); returns the file names."""
    out_dir = Path(out_dir)
    plan = plan_shards({k: t.numel() * t.element_size() for k, t in tensors.items()}, max_shard_bytes)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name, fname in plan.items():
        files.setdefault(fname, {})[name] = tensors[name].detach().contiguous().cpu()
    for fname, shard in files.items():
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
    if len(files) > 1:
        write_index(out_dir, plan)
    return list(files)
