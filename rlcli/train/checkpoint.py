"""Trainer checkpoints: model + optimizer + scheduler + data position, for resume.

Saved with torch.distributed.checkpoint (DCP): under FSDP2 / EP every rank writes its
own shards into one directory (``shared_atomic_dir``: rank 0 creates the temporary
directory, and renames and marks it STABLE after a barrier). DCP stores global shapes and
reshards on load, so a checkpoint written with another --dp/--cp/--ep mesh resumes on
this one. The newest STABLE checkpoint whose manifest checks out (sizes of every file,
sha256 of the metadata; ``rlcli.transport.atomic.verify_dir``) is resumed, so a crash
mid-save loses at most one interval and a damaged newest checkpoint falls back to the
one before it.
"""

import logging

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rlcli.parallel import dist as pdist
from rlcli.transport.atomic import clean_temporaries, read_marker, remove_dir, verify_dir
from rlcli.transport.rundir import RunDir

log = logging.getLogger("rl-train")


def newest_intact(run: RunDir) -> int | None:
    """The newest STABLE checkpoint that passes :func:`verify_dir` (each damaged newer one named in a warning)."""
    for step in reversed(run.stable_steps("checkpoints")):
        problems = verify_dir(run.checkpoint_dir(step))
        if not problems:
            return step
        log.warning("checkpoint step %d is damaged (%s); trying the one before", step, "; ".join(problems))
    return None


def save_checkpoint(run: RunDir, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, extra: dict, keep: int, mesh: dict | None = None) -> None:
    """Every rank calls this; ``mesh`` (dp/cp/ep) is recorded in the STABLE marker."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "extra": extra}
    with pdist.shared_atomic_dir(run.checkpoint_dir(step), {"step": step, "parallel": mesh}) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=str(tmp))
    if not pdist.enabled() or torch.distributed.get_rank() == 0:
        for old in run.stable_steps("checkpoints")[:-keep]:
            remove_dir(run.checkpoint_dir(old))


def load_latest_checkpoint(run: RunDir, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           scheduler) -> dict | None:
    """Restore the newest complete checkpoint into model/optimizer/scheduler; its ``extra``
    dict (step, data position, and "parallel": the mesh it was written with), or None."""
    if not pdist.enabled() or torch.distributed.get_rank() == 0:
        clean_temporaries(run.root / "checkpoints")
    step = pdist.broadcast_object(newest_intact(run) if not pdist.enabled() or torch.distributed.get_rank() == 0
                                  else None)
    if step is None:
        return None
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "extra": {"step": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(run.checkpoint_dir(step)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return {**state["extra"], "parallel": (read_marker(run.checkpoint_dir(step)) or {}).get("parallel")}
