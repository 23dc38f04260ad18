"""The engine's side of a weight update: ``WeightReceiver`` for the native engine.

Filesystem: the tensors are copied straight into the model's parameters, one by one (a
per-expert HF tensor lands in its slice of the stacked expert weight), so a load never
holds a second full copy of the model. Everything that can be checked is checked before the first parameter is
touched: the STABLE marker and its manifest (the size of every file, the checksum of the
index and config: a torn or truncated shard, a corrupt index or marker fail here), the
checksum of each shard, hashed through the mapping the tensors are then copied from (the
in-place copy must not start on a corrupt file, so the hash comes first; it is the
file's one read from storage), each file's safetensors header against its size, and that
the tensors cover every parameter exactly once with the right shapes. A failed check
leaves the engine serving its previous version.

Collective: the parameters are views of one flat buffer in the transfer's byte order
(:class:`Arena`), so every bucket is received straight into them, with no scratch and no
copy. The tensor list is checked against the model first; a mismatching list is still
received (into a scratch buffer, so the other members' transfer goes on) and then
refused with the model untouched. A transfer that breaks midway (a peer died, the
deadline passed) has overwritten some parameters: the receiver marks the weights torn,
and the engine generates nothing until a complete load arrives (requests wait, none is
dropped; rl-sync re-sends in a new group).
"""

import time
from pathlib import Path
from typing import Sequence

import torch

from rlcli.errors import ModelLoadError
from rlcli.models.hf_io import _ignorable, hf_entries, hf_state_dict
from rlcli.models.safetensors_io import SafetensorsFile, weight_files
from rlcli.transport.atomic import checksums_of, marker_problem, read_marker, verify_dir
from rlcli.transport.collective import Spec, WeightGroup, connect_store, parse_dtype, receive_flat, sender_group


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
    dests = destinations(model)
    if any(n.endswith("weight_scale_inv") for n in [*dests, *(n for f in files for n in f.keys())]):
        # FP8 + scales on either side (an FP8 engine loading the trainer's high-precision weights
        # quantizes them as load_model does): the FP8-aware loader, after the checks above.
        from rlcli.models.hf_io import load_weights

        return load_weights(model, source)
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


def _parameter(model: torch.nn.Module, name: str) -> torch.nn.Parameter | None:
    try:
        return model.get_parameter(name)
    except AttributeError:  # a buffer
        return None


class Arena:
    """One flat buffer laid out as a transfer's byte stream (``specs`` back to back) whose
    views ARE the model's parameters, so a transfer lands in them with no copy.

    Built at a receiver's first collective load (and again if the tensor list changes): the
    current weights are copied in and each parameter is rebound (``param.data``) to its view.
    A stacked expert weight is one view over its experts' consecutive tensors. A parameter
    that cannot be a view (another dtype than it travels in, its tensors not consecutive in
    the list, a misaligned offset) or a buffer stays where it is and is copied from the
    arena after each transfer. It costs one extra copy of the model while it is built."""

    def __init__(self, model: torch.nn.Module, specs: Sequence[Spec], device: torch.device):
        self.given, self.specs = specs, list(specs)  # given: the caller's list, usually passed again as is
        starts = [0]
        for s in self.specs:
            starts.append(starts[-1] + s.nbytes)
        self.flat = torch.empty(starts[-1], dtype=torch.uint8, device=device)
        index = {s.name: i for i, s in enumerate(self.specs)}
        self.model = model
        self.copies: list[tuple[torch.Tensor, torch.Tensor, Spec]] = []  # (destination, its bytes in flat, spec)
        self.bound: list[tuple[torch.nn.Parameter, int]] = []  # (parameter, the address of its view)
        for sd_name, t, names in hf_entries(model):
            ids = [index[n] for n in names]
            param = _parameter(model, sd_name)
            a, b = starts[ids[0]], starts[ids[-1] + 1]
            if (param is not None and ids == list(range(ids[0], ids[0] + len(ids))) and param.is_contiguous()
                    and all(self.specs[i].dtype == param.dtype for i in ids) and a % 16 == 0
                    and b - a == param.numel() * param.dtype.itemsize):
                view = self.flat[a:b].view(param.dtype).view(param.shape)
                view.copy_(param.data)
                param.data = view
                self.bound.append((param, view.data_ptr()))
                continue
            for e, i in enumerate(ids):
                s = self.specs[i]
                raw = self.flat[starts[i]:starts[i + 1]]
                self.copies.append((t if len(names) == 1 else t[e], raw, s))

    @property
    def num_bound(self) -> int:
        return len(self.bound)

    def fits(self, model: torch.nn.Module, specs: Sequence[Spec]) -> bool:
        """Built for this model and tensor list, and every bound parameter still is its view
        (a loader that replaced a parameter's storage unbinds it)."""
        return (model is self.model and (specs is self.given or self.specs == list(specs))
                and all(p.data_ptr() == ptr for p, ptr in self.bound))

    def scatter(self) -> None:
        """Copy the received bytes of the tensors that are not views into their places."""
        for dest, raw, s in self.copies:
            src = raw.view(s.dtype) if raw.storage_offset() % s.dtype.itemsize == 0 else raw.clone().view(s.dtype)
            dest.copy_(src.view(s.shape))


class CollectiveReceiver:
    """This server's membership in the weight-transfer group (kept across updates while
    the generation stays the same) and its :class:`Arena`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.groups: list[WeightGroup] = []  # this member's group of each trainer sender
        self.key: tuple = ()
        self.torn = False
        self.arena: Arena | None = None
        self.at: dict[str, float] = {}  # when each phase of the last load ended (time.monotonic())

    @torch.no_grad()
    @property
    def group(self) -> WeightGroup | None:
        """The group of the round's first sender, None when not joined."""
        return self.groups[0] if self.groups else None

    def load(self, model: torch.nn.Module, store: str, group: str, rank: int, world_size: int, version: int,
             specs: Sequence[Spec], bucket_bytes: int, timeout_s: float, senders: int = 1) -> None:
        self.at = {"start": time.monotonic()}
        fits = self.arena is not None and self.arena.fits(model, specs)  # checked when it was built
        dests = {} if fits else destinations(model)
        problem = None if fits else next((f"tensor {s.name} is not in the model" if s.name not in dests else
                        f"tensor {s.name} has shape {list(s.shape)}, the model has {list(dests[s.name].shape)}"
                        for s in specs if s.name not in dests or tuple(dests[s.name].shape) != s.shape), None)
        if problem is None and not fits:
            covered = {s.name for s in specs}
            missing = [n for n in dests if n not in covered]
            problem = f"the transfer lacks tensor {missing[0]}" if missing else None
        try:
            self.join(store, group, rank, world_size, timeout_s, senders)
            self.at["joined"] = time.monotonic()
            if problem is None:
                if not fits:
                    self.arena = None  # the old views stay alive as long as parameters use them
                    self.arena = Arena(model, specs, self.device)
                    self.at["arena"] = time.monotonic()

                def landing() -> None:  # from the first byte until the last has landed
                    self.torn = True
                    self.at["header"] = time.monotonic()

                receive_flat(self.groups, version, specs, bucket_bytes, self.arena.flat, landing)
                self.at["received"] = time.monotonic()
                self.arena.scatter()
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                self.torn = False
            else:  # received all the same (the other members' transfer goes on), then refused
                receive_flat(self.groups, version, specs, bucket_bytes,
                             torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8, device=self.device))
        except Exception:
            self.close()  # a broken group is never reused
            raise
        self.at["loaded"] = time.monotonic()
        if problem is not None:
            raise ModelLoadError(f"weights v{version} do not fit this model: {problem}")

    def join(self, store: str, group: str, rank: int, world_size: int, timeout_s: float,
             senders: int = 1) -> list[WeightGroup]:
        """The round's groups, one per trainer sender: this server's current ones when the round
        names them, else new ones."""
        key = (store, group, rank, world_size, senders)  # a restarted rl-sync reuses group names with a new store
        if not self.groups or self.key != key:
            self.close()
            client = connect_store(store, timeout_s)
            for k in range(senders):
                self.groups.append(WeightGroup(client, sender_group(group, k), rank, world_size, self.device,
                                               timeout_s))
            self.key = key
        return self.groups

    def close(self) -> None:
        for g in self.groups:
            g.close()
        self.groups = []


class WeightReceiver:
    """The native engine's receiver: dispatches on the ``WeightsRef`` type."""

    def __init__(self, device: torch.device):
        self.collective = CollectiveReceiver(device)
        self._tensors: list = []
        self._specs: list[Spec] = []

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
            if ref.tensors != self._tensors:  # the same list every update: parsed once
                self._tensors = ref.tensors
                self._specs = [Spec(t.name, parse_dtype(t.dtype), tuple(t.shape)) for t in ref.tensors]
            specs = self._specs
            self.collective.load(model, ref.store, ref.group, ref.rank, ref.world_size, version, specs,
                                 ref.bucket_bytes, ref.timeout_s, ref.senders)
        else:
            raise ValueError(f"the native engine cannot receive {type(ref).__name__}")

    def close(self) -> None:
        self.collective.close()
