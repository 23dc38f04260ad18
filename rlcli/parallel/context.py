"""Context parallelism: each packed row is split over the CP ranks; K/V are all-gathered.

API (called from the trainer / ``rlcli.parallel.parallelize``)::

    apply_cp(model, cp_group)                       # hook every layer's InnerAttention
    t = next_token_targets(t)                       # before sharding: targets + loss inputs aligned
    t_local, attn = shard_batch_for_cp(t, cp_rank, cp_size)   # other values (floats) pass through
    ctx = ForwardContext(attn=attn, routing=...)    # attn: PackedCausalAttention of the full rows
    sums = all_reduce_sums({"loss": ..., "num_tokens": ...}, group)   # one collective

Causal load balancing: a row of T tokens (padded to a multiple of 2*cp with a separate
padding document) is cut into 2*cp chunks; rank r holds chunks r and 2cp-1-r, so every
rank has the same share of the causal triangle. Positions stay the original ones (RoPE
is applied to each token at its true position before K/V leave the rank).

Per layer, ``k`` and ``v`` are packed into one buffer and all-gathered ONCE (one
collective per layer, not a ring); the backward of that gather is one reduce-scatter.
The gathered chunks are put back in row order and each rank attends its local queries
to the whole row with the document mask of the full row (built once per forward, on the
host, from the full position ids: see :class:`rlcli.ops.document_attention.PackedCausalAttention`).
Peak K/V memory per layer is the full row's K/V, which is what lets long rows fit:
activations and every other tensor are 1/cp of the row.

The loss needs no communication inside the model: the logits at position t score the
target ``input_ids[t+1]``, which :func:`next_token_targets` stores beside position t
before the row is cut, so no rank needs its neighbour's tokens. Each rank's loss sum is
divided by the global loss-token count (from the batch file) and gradients are summed
across ranks (FSDP's reduce-scatter); metrics sums go through :func:`all_reduce_sums`.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from rlcli.errors import ConfigError
from rlcli.ops.attention import InnerAttention
from rlcli.ops.document_attention import AttentionBackend, PackedCausalAttention
from rlcli.ops.prefix_tree import RowTree

# Per-token loss inputs that belong to the token being predicted.
TARGET_KEYS = ("loss_mask", "advantages", "inference_logprobs", "versions")
_PAD_VALUES = {"versions": -1}


# torch 2.13 renamed the single-tensor collectives; 2.11 (the GPU image) has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group(group_or_mesh):
    return group_or_mesh.get_group() if hasattr(group_or_mesh, "get_group") else group_or_mesh


def next_token_targets(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Realign a packed batch for a loss that needs no neighbouring tokens: adds ``targets``
    (``input_ids[t+1]``) and shifts the :data:`TARGET_KEYS` left by one, so position t
    carries everything about the token its logits predict. The last position of a row
    predicts nothing (mask False)."""
    out = dict(t)
    out["targets"] = torch.nn.functional.pad(t["input_ids"][:, 1:], (0, 1))
    for key in TARGET_KEYS:
        if key in t:
            x = t[key]
            out[key] = torch.cat([x[:, 1:], torch.full_like(x[:, :1], _PAD_VALUES.get(key, 0))], dim=1)
    return out


def cp_query_index(T: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Row indices held by ``cp_rank`` (T divisible by 2 * cp_size): chunks r and 2cp-1-r."""
    C = T // (2 * cp_size)
    first, second = cp_rank * C, (2 * cp_size - 1 - cp_rank) * C
    return torch.cat([torch.arange(first, first + C), torch.arange(second, second + C)])


def rank_tokens(num_tokens: int, cp_size: int) -> int:
    """Tokens a CP rank holds of a row of ``num_tokens`` (:func:`shard_batch_for_cp`: padded to a multiple
    of 2*cp, two chunks each), its GEMMs' M; with ``num_tokens`` a micro-batch's bound, this rank's.
    Without CP (``cp_size`` 1) the row is not cut: all of it."""
    return num_tokens if cp_size == 1 else -(-num_tokens // (2 * cp_size)) * 2


def check_cp(cp_size: int, num_tokens: int) -> None:
    """A row must give every CP rank at least one token of each of its two chunks."""
    if num_tokens < 2 * cp_size:
        raise ConfigError(f"--cp {cp_size} splits each row into {2 * cp_size} chunks, but a row holds only "
                          f"{num_tokens} tokens; lower --cp (at most {max(num_tokens // 2, 1)}) or pack longer rows")


def shard_batch_for_cp(t: dict, cp_rank: int, cp_size: int, backend: AttentionBackend = "auto",
                       host_position_ids: torch.Tensor | None = None, tree: RowTree | None = None
                       ) -> tuple[dict, PackedCausalAttention]:
    """This rank's part of a packed batch and the attention backend for it.

    Every ``[B, T, ...]`` tensor of ``t`` is padded to a multiple of 2*cp (padding is a
    document of its own, with no loss) and cut to this rank's two chunks;
    ``routed_experts`` (``[B*T, layers, k]``) likewise. The returned attention holds the
    full rows' document structure and this rank's query indices. Pass the positions' host
    copy as ``host_position_ids`` (e.g. from the batch file) to spare a device sync, and a
    shared-prompt row's ``tree`` (one row): a shared prompt may then be cut across ranks,
    each rank's queries attending to the whole row's keys through the tree's mask."""
    ids = t["input_ids"]
    B, T = ids.shape
    check_cp(cp_size, T)
    pad = -T % (2 * cp_size)
    trees = None
    if tree is not None:
        assert B == 1, B
        trees = [tree.padded(pad)]
        pad_values = dict(_PAD_VALUES, segment_ids=len(tree.spans))
    else:
        pad_values = _PAD_VALUES

    def padded(position_ids):
        pad_pos = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype).expand(B, pad)
        return torch.cat([position_ids, pad_pos], dim=1) if pad else position_ids

    position_ids = padded(t["position_ids"])
    host_positions = padded(host_position_ids.view(B, T)) if host_position_ids is not None else position_ids
    index = cp_query_index(T + pad, cp_rank, cp_size)
    out = {}
    for key, x in t.items():
        if not isinstance(x, torch.Tensor):  # e.g. the sampling temperature
            out[key] = x
            continue
        flat_tokens = key == "routed_experts"
        if flat_tokens:
            x = x.view(B, T, *x.shape[1:])
        if x.dim() < 2 or x.shape[:2] != (B, T):
            out[key] = x
            continue
        if key == "position_ids":
            x = position_ids
        elif pad:
            x = torch.cat([x, torch.full((B, pad, *x.shape[2:]), pad_values.get(key, 0), dtype=x.dtype,
                                         device=x.device)], dim=1)
        x = x[:, index.to(x.device)]
        out[key] = x.reshape(-1, *x.shape[2:]) if flat_tokens else x
    return out, PackedCausalAttention(host_positions, backend=backend, query_index_T=index, device=ids.device,
                                      trees=trees)


class _GatherRows(torch.autograd.Function):
    """All-gather along a new leading dim; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty(size * x.shape[0], *x.shape[1:])
        _all_gather_single(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(out, grad.flatten(0, 1), group=ctx.group)
        return out, None


def gather_kv(k_BTHD: torch.Tensor, v_BTHD: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-row K and V, in row order, from every rank's two chunks: one all-gather."""
    B, T, H, Dk = k_BTHD.shape
    Dv = v_BTHD.shape[-1]
    kv = torch.cat([k_BTHD.reshape(B, T, H * Dk), v_BTHD.reshape(B, T, -1)], dim=-1)
    g = _GatherRows.apply(kv, group)  # [cp, B, T, F], rank r's T = chunks (r, 2cp-1-r)
    C = T // 2
    first, second = g[:, :, :C], g[:, :, C:].flip(0)
    full = torch.cat([first.transpose(0, 1).flatten(1, 2), second.transpose(0, 1).flatten(1, 2)], dim=1)
    k, v = full.split([H * Dk, full.shape[-1] - H * Dk], dim=-1)
    return k.reshape(B, -1, H, Dk), v.reshape(B, -1, v_BTHD.shape[2], Dv)


def apply_cp(model: nn.Module, cp_group) -> None:
    """Make every attention layer of ``model`` gather K/V over ``cp_group`` before attending.
    The forward's ``ctx.attn`` must come from :func:`shard_batch_for_cp`."""
    group = _group(cp_group)

    def gather_hook(module, args):
        q, k, v, scale, ctx = args
        k, v = gather_kv(k, v, group)
        return q, k, v, scale, ctx

    for module in model.modules():
        if isinstance(module, InnerAttention):
            module.register_forward_pre_hook(gather_hook)


def all_reduce_sums(sums: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
    """Sum scalar metrics (loss sums, token counts) over ``group`` in one collective."""
    if not sums:
        return {}
    keys = list(sums)
    device = next((v.device for v in sums.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    flat = torch.stack([torch.as_tensor(sums[k]).detach().to(device, torch.float64).reshape(()) for k in keys])
    dist.all_reduce(flat, group=_group(group) if group is not None else None)
    return dict(zip(keys, flat.unbind(0)))
