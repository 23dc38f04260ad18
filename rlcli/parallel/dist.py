"""The process group of one rl-train job, and the few collectives its run-directory I/O needs.

Host-side collectives (barriers around shared directories, objects, row counts) go over a
gloo group even when the default group is NCCL, so they never wait for the device.

Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set) every rank joins the default group:
NCCL when CUDA is available (device ``cuda:LOCAL_RANK``), gloo on CPU. A plain process
(no torchrun) is rank 0 of 1 and creates no group, unless it asks for one to shard its
model over (``one_rank_group``: FSDP2's fp32 masters for a mixed-precision trainer of one
rank, ``rlcli.parallel.dims``); every helper here then degrades to the single-process
behaviour, so the trainer has one code path.
"""

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rlcli.errors import ConfigError
from rlcli.transport.atomic import begin_dir, commit_dir, storage_full
from rlcli.transport.checksum import file_checksum


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(one_rank_group: bool = False) -> DistInfo:
    """Join torchrun's job (when there is one) and pick this rank's device. ``one_rank_group``:
    a process alone in its job still gets a default group (of itself, in memory) to build a
    device mesh on; :func:`shutdown` destroys it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU: this host shows {torch.cuda.device_count()}; "
                              "run at most that many ranks per node (--nproc), or set CUDA_VISIBLE_DEVICES= to "
                              "train on the CPU")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    global _cpu_group, _own_one_rank_group
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
            # Host-side metadata (row counts) travels over gloo: no device sync for it.
            _cpu_group = dist.new_group(backend="gloo")
        else:
            dist.init_process_group("gloo")
    elif world == 1 and one_rank_group and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
        _own_one_rank_group = True
    return DistInfo(rank, world, local_rank, device)


_cpu_group = None
_own_one_rank_group = False


def shutdown() -> None:
    """Destroy the one-rank group :func:`init_distributed` made (another trainer, or a test, in this
    process may then make its own); torchrun's groups live as long as their process."""
    global _own_one_rank_group
    if _own_one_rank_group and dist.is_initialized():
        dist.destroy_process_group()
    _own_one_rank_group = False


def enabled() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def new_cpu_group():
    """A gloo group of every rank, for a thread's host-side collectives beside the main thread's
    (a background checkpoint's); None without a process group. Collective: every rank calls it."""
    return dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None


def barrier(group=None) -> None:
    if enabled():
        dist.barrier(group=group or _cpu_group)


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """``obj`` of rank ``src`` on every rank (``group``: host-side, default the process's gloo group)."""
    if not enabled():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group or _cpu_group)
    return box[0]


def all_gather_objects(obj: Any, group=None) -> list[Any]:
    if not enabled():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group or _cpu_group)
    return out


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum over ``group`` (default: every rank); on device, no host sync."""
    if enabled():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place max over ``group`` (default: every rank); on device, no host sync."""
    if enabled():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_reduce_max_int(value: int) -> int:
    """The largest ``value`` of any rank: a host-side int over a gloo group, so it never
    waits for the device."""
    if not enabled():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group)
    return int(t.item())


@contextlib.contextmanager
def shared_atomic_dir(final: str | Path, marker: dict[str, Any] | None = None,
                      own_files: str | None = None, group=None) -> Iterator[Path]:
    """:func:`rlcli.transport.atomic.atomic_dir` for a directory every rank writes into.

    Rank 0 creates the temporary directory (its name carries rank 0's host and pid) and
    tells the others; after a barrier (every rank done writing) rank 0 moves it into place
    and marks it STABLE; a second barrier keeps any rank from racing ahead of the marker.
    ``own_files`` (a glob with ``{rank}``, e.g. DCP's ``__{rank}_*``) names the files each
    rank wrote: each rank takes their checksums itself (from its own page cache), so rank 0's
    manifest reads no other rank's file. ``group``: the host-side group its collectives run on
    (:func:`new_cpu_group` for a writer thread; default the process's).
    """
    tmp = Path(broadcast_object(str(begin_dir(final)) if not enabled() or dist.get_rank() == 0 else None,
                                group=group))
    try:
        yield tmp
        sums: dict[str, str] = {}
        if own_files is not None:
            rank = dist.get_rank() if enabled() else 0
            sums = {p.name: file_checksum(p) for p in tmp.glob(own_files.format(rank=rank))}
            if enabled():
                sums = {k: v for part in all_gather_objects(sums, group) for k, v in part.items()}
        barrier(group)
        if not enabled() or dist.get_rank() == 0:
            commit_dir(tmp, final, marker, sums)
        barrier(group)
    except BaseException as e:
        full = storage_full(e, final, written=tmp)  # before the temporary's space is freed
        if not enabled() or dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from None
        raise
