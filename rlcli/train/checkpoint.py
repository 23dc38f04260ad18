"""Trainer checkpoints: model + optimizer + scheduler + data position, for resume.

Saved with torch.distributed.checkpoint (DCP) so that the same code writes sharded
checkpoints once FSDP2 / EP shard the model: every rank writes its own shards, and a
checkpoint written at one world size loads at another. Each checkpoint is built in a
temporary directory and marked STABLE only when complete; the newest STABLE one is
resumed, so a crash mid-save loses at most one interval.
"""

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rlcli.transport.atomic import atomic_dir, clean_temporaries, remove_dir
from rlcli.transport.rundir import RunDir


def save_checkpoint(run: RunDir, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, extra: dict, keep: int) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "extra": extra}
    with atomic_dir(run.checkpoint_dir(step), {"step": step}) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=str(tmp))
    for old in run.stable_steps("checkpoints")[:-keep]:
        remove_dir(run.checkpoint_dir(old))


def load_latest_checkpoint(run: RunDir, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           scheduler) -> dict | None:
    """Restore the newest complete checkpoint into model/optimizer/scheduler; its ``extra``
    dict (step, data position), or None when there is none."""
    clean_temporaries(run.root / "checkpoints")
    step = run.latest_stable("checkpoints")
    if step is None:
        return None
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "extra": {"step": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(run.checkpoint_dir(step)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return state["extra"]
