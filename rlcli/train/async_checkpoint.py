"""Checkpoints off the trainer's critical path: snapshot on the trainer thread, write behind it.

A checkpoint is the whole trainer state (model, optimizer moments, scheduler, data position);
written every step (``train.checkpoint.interval`` 1) on the trainer's thread it costs a
filesystem write per step that the next step waits for. As in torchtitan's async
checkpointing, :class:`AsyncCheckpointer` splits it in two:

1. ``save`` (trainer thread): the state is copied into host buffers kept from one save to the
   next (pinned host memory for GPU tensors, copied with ``non_blocking`` and fenced by a CUDA
   event the writer waits on). Once it returns, the next optimizer step may change the model.
2. a writer thread hands the copy to :func:`rlcli.train.checkpoint.write_checkpoint`, the
   same function the synchronous path runs, so both write the same files: temporary
   directory, fsync, rename, STABLE marker with its manifest, then the old checkpoints are
   pruned.

At most one save is in flight: the next ``save`` first waits for the previous one (the
buffers are reused), and a failed write raises there, or in ``wait``/``close``. ``close``
(the trainer's shutdown, also on SIGTERM) waits for the pending write. A crash before the
commit leaves only a temporary directory, which the next start removes; the newest
checkpoint that was committed is resumed, exactly as after a crash mid-save of the
synchronous path: the work since it is redone from the batches the orchestrator keeps
(it deletes none past the trainer's oldest checkpoint).

Sharded trainers (torchrun: FSDP2 / EP / CP, and one rank holding fp32 masters as DTensors)
save this way too. Each rank copies its own shards (a DTensor's local tensor, wrapped again in
the same sharding spec, so DCP writes the same files and metadata), and every rank's writer
thread runs DCP's collectives and the commit's barriers on a gloo group of its own
(``group``, :func:`rlcli.parallel.dist.new_cpu_group`), so they never interleave with the
training's collectives on the main thread. All ranks save the same steps in the same order, so
their writers meet in the same collectives.
"""

import copy
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from rlcli.errors import RLCLIError
from rlcli.train.checkpoint import write_checkpoint
from rlcli.transport.rundir import RunDir


class AsyncCheckpointer:
    """Snapshot now, write in the background; one save in flight (see the module docstring)."""

    def __init__(self, run: RunDir, keep: int, mesh: dict | None = None, group=None, keep_every: int = 0):
        self.run, self.keep, self.mesh, self.group, self.keep_every = run, keep, mesh, group, keep_every
        self._buffers: dict[str, torch.Tensor] = {}  # state path -> host copy, reused by every save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.pending_step: int | None = None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
             extra: dict) -> None:
        """Copy the state and start writing checkpoint ``step``; returns once the trainer may
        change the model again (after waiting for the previous save)."""
        self.wait()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "extra": extra}
        fence = None
        snapshot = self._copy(state, "")
        if any(t.is_cuda for t in self._live_tensors(state)):
            fence = torch.cuda.Event()
            fence.record()
        self.pending_step = step
        self._thread = threading.Thread(target=self._write, args=(step, snapshot, fence), daemon=True,
                                        name=f"checkpoint-{step}")
        self._thread.start()

    def _live_tensors(self, obj: Any):
        if isinstance(obj, DTensor):
            yield obj.to_local()
        elif isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from self._live_tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from self._live_tensors(v)

    def _copy(self, obj: Any, path: str) -> Any:
        """``obj`` with every tensor copied into this checkpointer's host buffer for ``path``."""
        if isinstance(obj, DTensor):  # this rank's shard, under the same spec (mesh, placements, global shape)
            return DTensor(self._copy(obj.to_local(), path), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            buf = self._buffers.get(path)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=obj.is_cuda)
                self._buffers[path] = buf
            buf.copy_(obj.detach(), non_blocking=obj.is_cuda)
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, f"{path}/{i}") for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _write(self, step: int, snapshot: dict, fence) -> None:
        try:
            if fence is not None:
                fence.synchronize()  # the device-to-host copies are done
            write_checkpoint(self.run, step, snapshot, self.keep, self.mesh, self.group, self.keep_every)
        except BaseException as e:  # surfaces on the next save / wait / close
            self._error = e

    def wait(self) -> None:
        """Block until no save is in flight; raise the error of a failed one."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.pending_step = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, RLCLIError):  # a full disk: the one line the synchronous path prints
                raise err
            raise RuntimeError(f"writing a checkpoint failed: {err}") from err

    def close(self) -> None:
        self.wait()
