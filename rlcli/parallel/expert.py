"""Expert parallelism: experts sharded over an EP group, tokens moved by all-to-all.

API (called from ``rlcli.parallel.parallelize``)::

    apply_ep(model, ep_group)          # ProcessGroup or 1-D DeviceMesh of ep ranks
    expert_load_metrics(model, group)  # load-balance metrics of the forwards since the last call

``apply_ep`` turns each ``GroupedExperts``' stacked weights ``[E, I, D]`` into DTensors
sharded ``Shard(0)`` over the EP mesh: the rank holds ``[E/ep, I, D]`` (experts
``ep_rank*E/ep ...``) while shape and offsets stay global, so sharded loading,
publishing and DCP checkpoints see the experts by their global index. The grouped GEMM
unwraps the local shard (``rlcli.ops.grouped_gemm``). The module's forward is wrapped
with two hooks; the model file is untouched:

* dispatch (pre-hook): the input is this rank's (token, expert) rows sorted by global
  expert, so they are already grouped by destination rank. Counts ``[ep, E/ep]`` are
  exchanged first (``all_to_all_single``), then the rows with uneven splits; the received
  rows (source-rank major) are permuted to local-expert major order for the grouped GEMM.
* combine (post-hook): the inverse permutation, then the reverse all-to-all.

Both permutations are gathers forward and backward (``rlcli.models.moe.permute``): no atomic adds.

Both all-to-alls are autograd-aware (backward is the reverse all-to-all). **The one host
sync** of an EP layer is reading the split sizes: ``all_to_all_single`` with uneven splits
takes them as Python ints. Everything else (counts, permutation) stays on the device.

Composition with FSDP2: expert weights are sharded over EP and then ``fully_shard`` over
the ranks holding the same expert slice (the "edp" axis of the 2-D ("edp", "ep") mesh the
EP mesh comes from; ``expert_replica_ranks``); dense weights over all ranks. Expert
gradients already sum over every token of the EP group (the all-to-all backward brings
them home), so ``fully_shard`` on the experts must use the same gradient divide factor
as on the dense modules (``set_gradient_divide_factor``), not its own mesh size. Expert
gradients live on another mesh than dense ones: a global gradient norm sums the squared
norms of the two groups (each reduced over its own mesh) before the square root.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from rlcli.errors import ConfigError
from rlcli.models.moe import GroupedExperts, MoE, inverse_permutation, permute


def _group(group_or_mesh):
    return group_or_mesh.get_group() if hasattr(group_or_mesh, "get_group") else group_or_mesh


def ep_groups_ranks(world_size: int, ep: int) -> list[list[int]]:
    """EP groups: ``ep`` consecutive ranks of the flattened dp x cp axis."""
    return [list(range(s, s + ep)) for s in range(0, world_size, ep)]


def expert_replica_ranks(world_size: int, ep: int) -> list[list[int]]:
    """Ranks holding the same expert slice (the FSDP / gradient-reduction axis of experts)."""
    return [list(range(i, world_size, ep)) for i in range(ep)]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty(sum(input_splits), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` along dim 0 with uneven splits."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def source_major_to_expert_major(counts_SE: torch.Tensor, total: int) -> torch.Tensor:
    """Gather index that reorders rows laid out source-rank major, ``(s0: e0 e1 ..), (s1: e0 e1
    ..)``, into local-expert major, ``(e0: s0 s1 ..), (e1: ..)``. ``counts_SE[s, e]`` rows of
    expert ``e`` came from source ``s``; ``total`` is their sum (known on the host)."""
    S, E = counts_SE.shape
    starts_SE = (torch.cumsum(counts_SE.reshape(-1), 0) - counts_SE.reshape(-1)).view(S, E)
    lens = counts_SE.t().reshape(-1)  # segments in output order (e, s)
    seg_starts = starts_SE.t().reshape(-1)
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=total)
    out_starts = torch.cumsum(lens, 0) - lens
    return seg_starts[seg] + torch.arange(total, device=lens.device) - out_starts[seg]


class ExpertParallel:
    """The dispatch/combine hooks of one ``GroupedExperts`` module. The permutation and splits
    of a dispatch wait in one slot for the combine that follows it (a slot, not a stack: an
    activation-checkpoint recompute that stops early may leave a dispatch without its combine)."""

    def __init__(self, group, ep_rank: int, ep_size: int):
        self.group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        self._pending: tuple[torch.Tensor, torch.Tensor, list[int], list[int]] | None = None

    def dispatch(self, module: GroupedExperts, args):
        x_RD, counts_E = args
        ep = self.ep_size
        send_counts = counts_E.view(ep, -1)
        recv_counts = torch.empty_like(send_counts)
        with torch.no_grad():
            dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        # The host sync: split sizes of the uneven all-to-all, one small device->host copy.
        splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).cpu().tolist()
        input_splits, output_splits = splits
        x_recv = all_to_all(x_RD, output_splits, input_splits, self.group)
        order = source_major_to_expert_major(recv_counts, x_recv.shape[0])
        inverse = inverse_permutation(order)
        self._pending = (order, inverse, input_splits, output_splits)
        return permute(x_recv, order, inverse), recv_counts.sum(0)

    def combine(self, module: GroupedExperts, args, y_RD: torch.Tensor) -> torch.Tensor:
        order, inverse, input_splits, output_splits = self._pending
        self._pending = None
        return all_to_all(permute(y_RD, inverse, order), input_splits, output_splits, self.group)


def apply_ep(model: nn.Module, ep_mesh) -> None:
    """Shard every ``GroupedExperts`` of ``model`` over ``ep_mesh`` (a 1-D DeviceMesh, or a
    ProcessGroup) and hook dispatch/combine. Works on a meta-device model (before loading)
    as well as on a materialized one."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(ep_mesh, DeviceMesh):
        p = next(model.parameters())
        ep_mesh = DeviceMesh.from_group(ep_mesh, "cpu" if p.device.type == "meta" else p.device.type)
    group = ep_mesh.get_group()
    ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    if not has_experts(model):
        raise ConfigError(f"--ep {ep_size} needs a mixture-of-experts model, and this one has no experts; drop --ep")
    for name, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        E = module.num_experts
        if E % ep_size:
            raise ConfigError(f"--ep {ep_size} must divide the number of experts ({E} in {name}); "
                              f"pick an --ep that divides {E}")
        e = E // ep_size
        lo = ep_rank * e
        for pname in ("w_gate", "w_up", "w_down"):
            p = getattr(module, pname)
            local = p.detach()[lo:lo + e].clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            setattr(module, pname, nn.Parameter(shard, requires_grad=p.requires_grad))
        module.num_experts, module.num_global_experts, module.expert_offset = e, E, lo
        module.ep_rank, module.ep_size = ep_rank, ep_size
        hooks = ExpertParallel(group, ep_rank, ep_size)
        module.register_forward_pre_hook(hooks.dispatch)
        module.register_forward_hook(hooks.combine)


def has_experts(model: nn.Module) -> bool:
    return any(isinstance(m, GroupedExperts) for m in model.modules())


def expert_load_metrics(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Load balance of the tokens routed since the last call, summed over ``group`` (the ranks
    whose tokens share the experts; None: no reduction): per MoE layer, the largest
    per-expert token fraction over the mean (1 = perfect balance) and the coefficient of
    variation of the per-expert counts; reported as the mean and the worst layer. Values
    stay on the device (0-d tensors): call ``float()`` when logging."""
    counts = [m.num_tokens_per_expert for m in model.modules()
              if isinstance(m, MoE) and m.num_tokens_per_expert is not None]
    for m in model.modules():
        if isinstance(m, MoE):
            m.num_tokens_per_expert = None
    if not counts:
        return {}
    counts_LE = torch.stack(counts).float()
    if group is not None:
        dist.all_reduce(counts_LE, group=_group(group))
    mean_L = counts_LE.mean(1).clamp(min=1e-9)
    max_over_mean_L = counts_LE.max(1).values / mean_L
    cv_L = counts_LE.std(1, unbiased=False) / mean_L
    return {"moe_max_over_mean": max_over_mean_L.mean(), "moe_max_over_mean_worst": max_over_mean_L.max(),
            "moe_cv": cv_L.mean(), "moe_cv_worst": cv_L.max()}
