"""Trainer-side parallelism, applied to a model from outside (model files hold architecture only).

Order, as in torchtitan: build the model on the meta device, ``parallelize`` it (expert
and context parallelism, activation checkpointing, then FSDP2 outermost), then have each
rank load only the slices it owns (:func:`rlcli.parallel.loading.load_sharded`).
"""

import torch

from rlcli.errors import ConfigError
from rlcli.parallel.dims import ParallelDims, resolve_dims
from rlcli.parallel.fsdp import apply_activation_checkpointing, apply_compile, apply_fsdp

__all__ = ["ParallelDims", "parallelize", "resolve_dims"]


def _import_optional(module: str, name: str, flag: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise ConfigError(f"{flag} > 1 needs {module}.{name}, which this build of rlcli does not have; "
                          f"drop {flag}") from None


def parallelize(model: torch.nn.Module, dims: ParallelDims, cfg, param_dtype: torch.dtype) -> torch.nn.Module:
    """Apply EP, CP, activation checkpointing and FSDP2 to ``model`` in place.

    ``cfg`` is the TrainConfig (``activation_checkpointing``, ``parallel.cpu_offload``);
    ``param_dtype`` is the compute dtype FSDP2 all-gathers parameters in (the parameters
    themselves stay in the dtype they were built with: fp32 master weights). ``dims`` must
    have been :meth:`~ParallelDims.build`-ed when it shards (:attr:`~ParallelDims.fsdp`).
    """
    if dims.ep > 1:
        _import_optional("rlcli.parallel.expert", "apply_ep", "--ep")(model, dims.ep_mesh["ep"])
    if dims.cp > 1:
        _import_optional("rlcli.parallel.context", "apply_cp", "--cp")(model, dims.mesh["cp"])
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    if dims.fsdp:
        apply_fsdp(model, dims.fsdp_mesh, param_dtype, cfg.parallel.cpu_offload, dims.ep_mesh, cfg.parallel.reshard)
    return model
