"""FSDP2 and activation checkpointing, applied to a built (usually meta) model from outside.

FSDP2: ``fully_shard`` on every decoder block, then on the root (embeddings, final norm,
LM head, and the tied weight when embeddings are tied). Parameters stay fp32 (master
weights); the mixed-precision policy all-gathers them in the compute dtype and reduces
gradients in fp32. ``cpu_offload`` keeps the sharded parameters, their gradients and so
the optimizer state in host memory (FSDP2's CPUOffloadPolicy; GPU runs). Blocks reshard
after forward (the backward all-gathers them again), unless ``reshard="step"``
(train.parallel.reshard): blocks then keep their gathered parameters from forward to
backward and, through :func:`sync_gradients_on`, from one micro-batch to the next;
gradients accumulate unsharded in fp32 and are reduce-scattered after the step's last
micro-batch (at one rank this removes every per-micro-batch cast and copy of the
collectives). The root keeps its parameters gathered until backward, FSDP2's default for
a root, which is what lets the trainer compute chunked logprobs from ``lm_head.weight``
after the forward call returns. Gradients are *summed* across ranks (divide factor 1): the trainer
divides the loss by the global token count itself.

Compilation (``train.compile``) compiles each decoder block in place (``Module.compile``:
module names and state-dict keys do not change), after activation checkpointing and
before FSDP2, the order torchtitan uses: the block graph fuses norms, rotary, SiLU and
the elementwise products around the matmuls; FSDP2's collectives stay outside it. The
logprob chunk math (cast, logsumexp, softmax gradient over ``[chunk, V]``) is compiled too.
With ``--fp8`` the FP8 linears and experts run eagerly between the block's compiled pieces
(``torch.compiler.disable``: their weight caches and sibling stacking are Python state), one
graph break per call; the pieces after each break are shared by all layers, so the number of
compiled frames does not grow with depth (tests/parallel/test_compile.py). With
``fp8.graph = "fused"`` the FP8 linears trace into the block graph instead (rlcli.ops.fp8.graph;
the experts stay eager). Attention runs
eagerly the same way, except FlexAttention (compiled on its own): its backends plan over each
batch's documents on the host, and a new document structure, every RL step, would otherwise
be traced again.

Activation checkpointing wraps each block's ``forward`` (module names, and so state-dict
keys, do not change): "full" recomputes the whole block in backward; "selective" keeps
the outputs of matmuls and attention kernels and recomputes the cheap, memory-heavy
rest (norms, rotary, SiLU, elementwise products).
"""

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_SAVE_OPS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
for _name in ("_grouped_mm", "_efficient_attention_forward", "_flash_attention_forward"):
    if hasattr(torch.ops.aten, _name):
        _SAVE_OPS.add(getattr(torch.ops.aten, _name).default)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed(forward, selective: bool):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        extra = {"context_fn": _selective_contexts} if selective else {}
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)

    return run


def apply_compile(model: torch.nn.Module) -> None:
    """Compile every decoder block in place, and the trainer's per-chunk logprob math
    (:func:`rlcli.ops.logprobs.use_compiled`); see module docstring."""
    from rlcli.ops.logprobs import use_compiled

    for block in model.model.layers:
        block.compile()
    use_compiled(True)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """``mode``: "none", "full" or "selective" (see module docstring)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"train.activation_checkpointing must be none, full or selective, got {mode!r}")
    for block in model.model.layers:
        block.forward = _checkpointed(block.forward, mode == "selective")


def apply_fsdp(model: torch.nn.Module, mesh, param_dtype: torch.dtype, cpu_offload: bool = False,
               ep_mesh=None, reshard: str = "micro_batch") -> None:
    """``fully_shard`` per block and on the root, over ``mesh`` (1-D: the flattened dp x cp
    axis). With ``ep_mesh``, each MoE layer's experts are sharded over its "edp" axis first
    (their "ep" split is expert parallelism's business). ``reshard``: see module docstring."""
    if reshard not in ("micro_batch", "step"):
        raise ValueError(f"train.parallel.reshard must be micro_batch or step, got {reshard!r}")
    after_forward = reshard == "micro_batch"
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # On a CPU-only mesh everything already lives in host memory: offloading is a no-op.
    offload = cpu_offload and mesh.device_type != "cpu"
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
              offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    layers = model.model.layers
    for block in layers:
        experts = getattr(block.mlp, "experts", None)
        if ep_mesh is not None and experts is not None:
            fully_shard(experts, mesh=ep_mesh["edp"], reshard_after_forward=after_forward, **kw)
        fully_shard(block, mesh=mesh, reshard_after_forward=after_forward, **kw)
    fully_shard(model, mesh=mesh, **kw)
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    # hidden_states() is how the trainer runs the model (logprobs are computed from hidden
    # states in chunks), so it must trigger FSDP's all-gathers like forward() does.
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(model, "hidden_states")


def sync_gradients_on(model: torch.nn.Module, last: bool) -> None:
    """Before each micro-batch under ``reshard="step"``: reduce gradients and reshard parameters
    after backward only when this is the step's ``last`` micro-batch (no-op without FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of parameters that may be DTensors on *different*
    meshes (dense ones over dp x cp, experts over ("edp", "ep")): each mesh's norm is
    reduced on its own mesh, the squares are summed, then every gradient is scaled.
    Returns the total norm as a plain tensor (no host sync)."""
    by_mesh: dict[int, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
    total_sq = None
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total_sq = norm.float() ** 2 if total_sq is None else total_sq + norm.float() ** 2
    if total_sq is None:
        return torch.zeros(())
    total = total_sq.sqrt()
    if max_norm:
        # Per mesh: one foreach op over DTensors of two meshes is refused ("different meshes").
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
