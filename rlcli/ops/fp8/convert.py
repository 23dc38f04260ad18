"""Swap a model's linears (and stacked MoE experts) for FP8 ones, from outside the model.

Model files keep plain ``nn.Linear`` and ``GroupedExperts``; ``convert_to_fp8`` replaces
the modules whose qualified names match the config's patterns. The replacements share the
original Parameters (same names, shapes and dtypes in the state dict), so optimizer,
checkpoints, weight publishing and FSDP2 see no difference: call it after building (or
loading) the model and before ``parallelize``/``fully_shard``. Trainer and inference
engine call it with the same config so both compute the same function.
"""

import fnmatch
import logging

import torch
import torch.nn as nn

from rlcli.models.moe import GroupedExperts
from rlcli.ops.fp8.backends import GemmBackend, make_backend
from rlcli.ops.fp8.linear import FP8Linear, fp8_grouped_mm
from rlcli.ops.fp8.runtime import WeightCache
from rlcli.ops.fp8.siblings import group_siblings
from rlcli.ops.grouped_gemm import local_weight

log = logging.getLogger("rlcli.fp8")


class FP8GroupedExperts(GroupedExperts):
    """Stacked SwiGLU experts whose three GEMMs are FP8 grouped GEMMs over expert-sorted tokens."""

    backend: GemmBackend
    ue8m0: bool

    @torch.compiler.disable
    def expert_mm(self, x_RK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        # One weight cache per projection; under expert parallelism the local shard is quantized.
        cache = self._caches[0 if w_ENK is self.w_gate else 1 if w_ENK is self.w_up else 2]
        return fp8_grouped_mm(x_RK, local_weight(w_ENK), offs_E, self.backend, cache, self.ue8m0)

    def refresh_weights(self) -> bool:
        """After a weight load: quantize the changed experts into the FP8 blocks already held, where
        the decode graphs read them (:meth:`WeightCache.refresh_in_place`); whether any changed."""
        return any([cache.refresh_in_place(local_weight(w), self.ue8m0)
                    for cache, w in zip(self._caches, (self.w_gate, self.w_up, self.w_down))])


def _matches(name: str, include: list[str], exclude: list[str]) -> bool:
    return (any(fnmatch.fnmatchcase(name, p) for p in include)
            and not any(fnmatch.fnmatchcase(name, p) for p in exclude))


def selected_modules(model: nn.Module, cfg) -> list[tuple[str, nn.Module]]:
    """The ``nn.Linear`` and ``GroupedExperts`` modules of ``model`` that ``cfg`` (an
    :class:`rlcli.config.model.Fp8Config`) selects for FP8, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if name and type(m) in (nn.Linear, GroupedExperts) and _matches(name, cfg.include, cfg.exclude)]


def convert_to_fp8(model: nn.Module, cfg, device: torch.device | str | None = None,
                   backend: GemmBackend | None = None, fp8_storage: bool = False) -> list[str]:
    """Replace, in place, every ``nn.Linear`` and ``GroupedExperts`` of ``model`` that ``cfg``
    (an :class:`rlcli.config.model.Fp8Config`) selects; returns the converted module names.
    The GEMM backend is made for ``device`` (default: where the model's parameters are).
    ``fp8_storage`` keeps the linears' weights in FP8 + ``weight_scale_inv`` (inference; on a
    meta model it sets the shapes an FP8 checkpoint loads into). Experts keep master weights.
    ``cfg.fuse_siblings`` names the sibling sets (qkv, gate_up) run stacked, training storage only (:mod:`.siblings`)."""
    if backend is None:
        if device is None:
            p = next(model.parameters(), None)
            device = p.device if p is not None and not p.is_meta else "cpu"
        backend = make_backend(cfg.backend, device, inference=fp8_storage)
    converted: list[str] = []
    for name, module in selected_modules(model, cfg):
        if type(module) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            new = FP8Linear.from_linear(module, backend, cfg.ue8m0, getattr(cfg, "graph", "eager"))
            if fp8_storage:
                new.to_fp8_storage()
            setattr(parent, child, new)
            converted.append(name)
        elif type(module) is GroupedExperts:
            module.__class__ = FP8GroupedExperts  # keeps its Parameters and hooks where they are
            module.backend, module.ue8m0 = backend, cfg.ue8m0
            module._caches = (WeightCache(), WeightCache(), WeightCache())
            converted.append(name)
    sets = getattr(cfg, "fuse_siblings", None) or []
    grouped = group_siblings(model, FP8Linear, sets) if sets and not fp8_storage else []
    log.info("fp8: %d modules converted (backend %s), %d sibling sets stacked%s", len(converted), backend.name,
             len(grouped), "" if converted else "; no module matched train/infer.fp8.include")
    return converted
