"""The engine's side of a weight update: ``WeightReceiver`` for the native engine.

Both paths write straight into the model's parameters, tensor by tensor (a per-expert
HF tensor lands in its slice of the stacked expert weight), so a load never holds a
second full copy of the model.

Filesystem: everything that can be checked is checked before the first parameter is
touched: the STABLE marker and its manifest (the size of every file, the checksum of the
index and config: a torn or truncated shard, a corrupt index or marker fail here), the
checksum of each shard, hashed through the mapping the tensors are then copied from (the
in-place copy must not start on a corrupt file, so the hash comes first; it is the
file's one read from storage), each file's safetensors header against its size, and that
the tensors cover every parameter exactly once with the right shapes. A failed check
leaves the engine serving its previous version.

Collective: the tensor list is checked against the model first; a mismatching list is
still received (into scratch tensors, so the other members' transfer goes on) and then
refused with the model untouched. A transfer that breaks midway (a peer died, the
deadline passed) has overwritten some parameters: the receiver marks the weights torn,
and the engine generates nothing until a complete load arrives (requests wait, none is
dropped; rl-sync re-sends in a new group).
"""

from pathlib import Path
from typing import Sequence

import torch

from rlcli.errors import ModelLoadError
from rlcli.models.hf_io import _ignorable, hf_state_dict
from rlcli.models.safetensors_io import SafetensorsFile, weight_files
from rlcli.transport.atomic import checksums_of, marker_problem, read_marker, verify_dir
from rlcli.transport.collective import Spec, WeightGroup, connect_store, parse_dtype, receive


def destinations(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> the parameter (or the slice of a stacked one) it is loaded into."""
    return {n: t for n, t in hf_state_dict(model).items()}


def _skippable(model, name: str) -> bool:
    return _ignorable(name, model.args) or (name == "lm_head.weight" and model.args.tie_word_embeddings)


def verified_files(path: str | Path) -> tuple[Path, list[SafetensorsFile]]:
    """The safetensors files of a published weights directory, after checking its marker
    and sizes; raises ModelLoadError naming what is wrong."""
    path = Path(path)
    bad_marker = marker_problem(path)
    if bad_marker is not None:
        raise ModelLoadError(bad_marker)
    marker = read_marker(path)
    if marker is None:
        raise ModelLoadError(f"{path} has no STABLE marker (not completely written)")
    source = Path(marker.get("source") or path)
    for fname, size in (marker.get("files") or {}).items():
        actual = (source / fname).stat().st_size if (source / fname).is_file() else -1
        if actual != size:
            raise ModelLoadError(f"{source / fname} holds {actual} bytes, its STABLE marker says {size}: torn shard")
    problems = verify_dir(path)  # the marker, every file's size, the checksum of index and config
    if problems:
        raise ModelLoadError(f"{path} is damaged: {'; '.join(problems)}")
    sums = checksums_of(path) if source == path else {}  # a "source" marker points at files rlcli did not write
    files = [SafetensorsFile(f, sums.get(f.name)) for f in weight_files(source)]
    if not files:
        raise ModelLoadError(f"{source} holds no safetensors files")
    for f in files:
        end = max((e["data_offsets"][1] for e in f.entries.values()), default=0)
        if f._base + end > len(f._mmap):
            raise ModelLoadError(f"{f.path} is truncated ({len(f._mmap)} bytes, header needs {f._base + end})")
    return source, files


@torch.no_grad()
def load_from_files(model: torch.nn.Module, path: str | Path) -> None:
    """Verify, then copy a published directory into ``model`` tensor by tensor."""
    source, files = verified_files(path)
    if any(n.endswith("weight_scale_inv") for f in files for n in f.keys()):
        from rlcli.models.hf_io import load_weights  # FP8 + scales: the FP8-aware loader, after the checks above

        return load_weights(model, source)
    dests = destinations(model)
    plan: list[tuple[SafetensorsFile, str, torch.Tensor]] = []
    seen: set[str] = set()
    for f in files:
        for name in f.keys():
            if name not in dests:
                if _skippable(model, name):
                    continue
                raise ModelLoadError(f"{source}: unexpected tensor {name} for model_type {model.args.model_type}")
            if list(f.shape(name)) != list(dests[name].shape):
                raise ModelLoadError(f"{source}: tensor {name} has shape {f.shape(name)}, "
                                     f"the model has {list(dests[name].shape)}")
            seen.add(name)
            plan.append((f, name, dests[name]))
    missing = [n for n in dests if n not in seen]
    if missing:
        raise ModelLoadError(f"{source}: missing tensor {missing[0]}")
    for f, name, dest in plan:
        dest.copy_(f.tensor(name))


class CollectiveReceiver:
    """This server's membership in the weight-transfer group (kept across updates while
    the generation stays the same)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.group: WeightGroup | None = None
        self.key: tuple = ()
        self.torn = False

    @torch.no_grad()
    def load(self, model: torch.nn.Module, store: str, group: str, rank: int, world_size: int, version: int,
             specs: Sequence[Spec], bucket_bytes: int, timeout_s: float) -> None:
        dests = destinations(model)
        problem = next((f"tensor {s.name} is not in the model" if s.name not in dests else
                        f"tensor {s.name} has shape {list(s.shape)}, the model has {list(dests[s.name].shape)}"
                        for s in specs if s.name not in dests or tuple(dests[s.name].shape) != s.shape), None)
        if problem is None:
            covered = {s.name for s in specs}
            missing = [n for n in dests if n not in covered]
            problem = f"the transfer lacks tensor {missing[0]}" if missing else None
        try:
            self.join(store, group, rank, world_size, timeout_s)
            if problem is None:
                self.torn = True  # until the last byte has landed
                receive(self.group, version, specs, bucket_bytes, lambda i: dests[specs[i].name])
                self.torn = False
            else:
                receive(self.group, version, specs, bucket_bytes,
                        lambda i: torch.empty(specs[i].shape, dtype=specs[i].dtype, device=self.device))
        except Exception:
            self.close()  # a broken group is never reused
            raise
        if problem is not None:
            raise ModelLoadError(f"weights v{version} do not fit this model: {problem}")

    def join(self, store: str, group: str, rank: int, world_size: int, timeout_s: float) -> WeightGroup:
        """The round's group: this server's current one when the round names it, else a new one."""
        key = (store, group, rank, world_size)  # a restarted rl-sync reuses group names with a new store
        if self.group is None or self.key != key:
            self.close()
            self.group = WeightGroup(connect_store(store, timeout_s), group, rank, world_size, self.device, timeout_s)
            self.key = key
        return self.group

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class WeightReceiver:
    """The native engine's receiver: dispatches on the ``WeightsRef`` type."""

    def __init__(self, device: torch.device):
        self.collective = CollectiveReceiver(device)

    @property
    def torn(self) -> bool:
        """A collective load broke midway: parameters hold a mix of two versions."""
        return self.collective.torn

    def load(self, model: torch.nn.Module, ref, version: int) -> None:
        from rlcli.protocol import FsWeights, NcclWeights

        if isinstance(ref, FsWeights):
            if self.torn:
                raise ModelLoadError("weights are torn by a broken collective load; only a collective load "
                                     "of the newest version can repair them")
            load_from_files(model, ref.path)
        elif isinstance(ref, NcclWeights):
            specs = [Spec(t.name, parse_dtype(t.dtype), tuple(t.shape)) for t in ref.tensors]
            self.collective.load(model, ref.store, ref.group, ref.rank, ref.world_size, version, specs,
                                 ref.bucket_bytes, ref.timeout_s)
        else:
            raise ValueError(f"the native engine cannot receive {type(ref).__name__}")

    def close(self) -> None:
        self.collective.close()
