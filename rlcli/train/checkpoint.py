"""Trainer checkpoints: model + optimizer + scheduler + data position, for resume.

Saved with torch.distributed.checkpoint (DCP): under FSDP2 / EP every rank writes its
own shards into one directory (``shared_atomic_dir``: rank 0 creates the temporary
directory, and renames and marks it STABLE after a barrier). DCP stores global shapes and
reshards on load, so a checkpoint written with another --dp/--cp/--ep mesh resumes on
this one. The newest STABLE checkpoint whose manifest checks out (the marker, sizes of
every file, checksum of the metadata; ``rlcli.transport.atomic.verify_dir``) is resumed, so
a crash mid-save loses at most one interval and a damaged newest checkpoint falls back to
the one before it.

Each rank takes the checksum of the shard files it wrote (``shared_atomic_dir(own_files=)``)
and each rank checks the files it reads: DCP's reader is handed each file as a read-only
memory mapping, hashed first (that pass reads the file from storage) and then parsed from
the same mapping (:class:`VerifyingReader`). A corrupt shard on
any rank fails the load on every rank (DCP gathers the ranks' read errors), and they all
fall back to the checkpoint before it together.
"""

import contextlib
import io
import logging
import mmap
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rlcli.errors import CorruptFile
from rlcli.parallel import dist as pdist
from rlcli.transport.atomic import checksums_of, clean_temporaries, read_marker, remove_dir
from rlcli.transport.checksum import verify
from rlcli.transport.rundir import RunDir, retired

log = logging.getLogger("rl-train")


class _MappedFile(io.RawIOBase):
    """A read-only file over a memory mapping: DCP parses the very bytes that were hashed."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset if whence == io.SEEK_SET else self.pos + offset if whence == io.SEEK_CUR \
            else len(self.view) + offset
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self.view) - self.pos))
        buffer[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n


class _VerifyingFileSystem(FileSystem):
    def __init__(self, sums: dict[str, str]):
        super().__init__()
        self.sums = sums

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        name = Path(path).name
        if mode != "rb" or name not in self.sums or not Path(path).stat().st_size:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                verify(path, view, self.sums[name])  # the file's one read from storage
                yield _MappedFile(view)
            finally:
                view.release()


class VerifyingReader(FileSystemReader):
    """DCP's filesystem reader, checking each file against the checksum of the checkpoint's manifest."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        self.fs = _VerifyingFileSystem(checksums_of(path))


def corrupt_file(e: BaseException) -> CorruptFile | None:
    """The :class:`CorruptFile` behind a DCP load failure (raised on any rank), or None."""
    if isinstance(e, CorruptFile):
        return e
    if isinstance(e, CheckpointException):
        return next((exc for exc, _ in e.failures.values() if isinstance(exc, CorruptFile)), None)
    return None


def save_checkpoint(run: RunDir, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, extra: dict, keep: int, mesh: dict | None = None, keep_every: int = 0) -> None:
    """Every rank calls this; ``mesh`` (dp/cp/ep) is recorded in the STABLE marker."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "extra": extra}
    write_checkpoint(run, step, state, keep, mesh, keep_every=keep_every)


def write_checkpoint(run: RunDir, step: int, state: dict, keep: int, mesh: dict | None = None,
                     group=None, keep_every: int = 0) -> None:
    """Write ``state`` ({"model", "optim", "scheduler", "extra"}) as checkpoint ``step``, commit it
    (rename, then STABLE) and delete all but the newest ``keep`` and the milestones (multiples of
    ``keep_every``, :func:`~rlcli.transport.rundir.retired`): the live state
    (:func:`save_checkpoint`) or a host snapshot of it (``rlcli.train.async_checkpoint``).
    ``group``: the gloo group DCP's and the commit's collectives run on (a writer thread's own;
    default the process's)."""
    with pdist.shared_atomic_dir(run.checkpoint_dir(step), {"step": step, "parallel": mesh},
                                 own_files="__{rank}_*", group=group) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=str(tmp), process_group=group)
    if not pdist.enabled() or torch.distributed.get_rank() == 0:
        for old in retired(run.stable_steps("checkpoints"), keep, keep_every):
            remove_dir(run.checkpoint_dir(old))


def load_latest_checkpoint(run: RunDir, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           scheduler) -> dict | None:
    """Restore the newest complete checkpoint into model/optimizer/scheduler; its ``extra``
    dict (step, data position, and "parallel": the mesh it was written with), or None."""
    if not pdist.enabled() or torch.distributed.get_rank() == 0:
        clean_temporaries(run.root / "checkpoints")
    skip: set[int] = set()  # checkpoints whose shards failed their checksum while loading
    while True:
        step = pdist.broadcast_object(run.newest_intact("checkpoints", skip) if not pdist.enabled() or
                                      torch.distributed.get_rank() == 0 else None)
        if step is None:
            return None
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "extra": {"step": 0}}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(state, storage_reader=VerifyingReader(run.checkpoint_dir(step)))
            break
        except (CorruptFile, CheckpointException) as e:
            corrupt = corrupt_file(e)
            if corrupt is None:
                raise
            log.warning("%s; trying the checkpoint before", corrupt)  # the next load overwrites every value
            skip.add(step)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return {**state["extra"], "parallel": (read_marker(run.checkpoint_dir(step)) or {}).get("parallel")}
