"""One training step over this rank's packed rows, with no host sync inside it.

``prepare`` turns a packed micro-batch into tensors aligned on the *predicting* position:
position t carries the target token t + 1 and that token's loss mask, advantage and
inference logprob, so a row can be cut anywhere (context parallelism) without losing a
pair. ``forward_backward`` runs the model to hidden states and computes logprobs (and
entropy) chunk by chunk from them (:mod:`rlcli.ops.logprobs`), never as full-vocab fp32
logits of the batch.

Normalization: the loss of every micro-batch on every rank is divided by the number of
loss tokens of the whole step, summed over the data-parallel ranks with an all-reduce on
device; FSDP2 then sums (not averages) gradients, so the update equals a single process
training on the whole batch. Ranks may hold different numbers of rows; every rank runs as
many forward/backward passes as the busiest one (FSDP's collectives must pair up), padding
with rows whose loss mask is empty.
"""

from typing import Callable

import torch

from rlcli.errors import ConfigError
from rlcli.models.moe import check_routes
from rlcli.ops.attention import ForwardContext, PackedCausalAttention, RoutingContext
from rlcli.ops.logprobs import chunked_logprobs
from rlcli.parallel import dist as pdist
from rlcli.parallel.fsdp import sync_gradients_on
from rlcli.protocol.batch import MicroBatch
from rlcli.train.data import to_tensors
from rlcli.train.loss import sequence_ids

_SHIFTED = ("loss_mask", "advantages", "inference_logprobs")


def prepare(mb: MicroBatch, device: torch.device, empty: bool = False) -> dict[str, torch.Tensor]:
    """[1, T] tensors of one packed row, aligned on predicting positions (module docstring).
    ``empty`` zeroes the loss mask (a padding pass). Host-side: ``tree`` (the row's segments,
    rlcli.ops.prefix_tree) and ``host_loss_mask`` (which positions score a loss token)."""
    t = to_tensors(mb, device)

    def shift(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)

    t["targets"] = shift(t["input_ids"])
    for name in _SHIFTED:
        t[name] = shift(t[name])
    if empty:
        t["loss_mask"] = torch.zeros_like(t["loss_mask"])
    tree = mb.tree()
    t["tree"] = tree
    t["segment_ids"] = torch.from_numpy(tree.segment_ids())[None].to(device, non_blocking=True)
    host_mask = torch.zeros(1, tree.num_tokens, dtype=torch.bool)
    if not empty:
        host_mask[0, :-1] = torch.from_numpy(mb.loss_mask.numpy()[1:].copy())
    t["host_loss_mask"] = host_mask
    # A sample's last token was never run by the engine (its route is a filler): leaf segment ends.
    # A padding pass counts no route (its row is counted where it is not padding).
    counted = torch.full((tree.num_tokens,), not empty, dtype=torch.bool)
    counted[[tree.spans[j][1] - 1 for j in tree.leaves()]] = False
    t["route_counted"] = counted[None].to(device, non_blocking=True)
    t["temperature"] = mb.temperature
    t["top_p"] = mb.top_p
    return t


def routing_for(t: dict, model: torch.nn.Module, r3: bool) -> RoutingContext | None:
    """R3: replay the engine's routes; refuse batches that disagree with this trainer's ``r3``."""
    routes = t.get("routed_experts")
    if not r3:
        if routes is not None:
            raise ConfigError("the rollout batch carries MoE routes (rl-orchestrate runs with r3) but "
                              "rl-train does not: set r3 = true for both")
        return None
    if routes is None:
        raise ConfigError("rl-train runs with r3 = true but the rollout batch has no routes: set r3 = true "
                          "for rl-orchestrate too")
    check_routes(routes, model.args, t["input_ids"].shape[1], t.get("routes_range"))
    if "route_counted" in t:
        return RoutingContext(replay=routes, counted=t["route_counted"].flatten())
    pos = t["position_ids"][0]
    last = torch.cat([pos[1:] == 0, pos.new_ones(1, dtype=torch.bool)])  # a sequence's last token: filler route
    return RoutingContext(replay=routes, counted=~last)


def forward_backward(model: torch.nn.Module, t: dict, normalizer: torch.Tensor, loss_fn: Callable, lcfg,
                     chunk: int, attn=None, r3: bool = False, attention: str = "auto",
                     keep_logits: bool = False) -> dict[str, torch.Tensor]:
    """Loss of one row divided by ``normalizer`` (device scalar), backward; sums for metrics.
    ``attn``: the attention backend for ``t`` (context parallelism builds its own); else one
    of kind ``attention`` (train.attention) is built. ``keep_logits``: train.logprob_keep_logits."""
    routing = routing_for(t, model, r3)
    if attn is None:
        trees = [t["tree"]] if "tree" in t else None
        attn = PackedCausalAttention(t["position_ids"], backend=attention, trees=trees, device=t["input_ids"].device)
    ctx = ForwardContext(attn=attn, routing=routing)
    h_BTD = model.hidden_states(t["input_ids"], t["position_ids"], ctx)
    lp, entropy = _loss_token_logprobs(h_BTD, model.lm_head.weight, t, chunk, keep_logits)
    mask = t["loss_mask"]
    seq_ids = t["segment_ids"] if "segment_ids" in t else sequence_ids(t["position_ids"])
    loss, kept, metrics = loss_fn(lp, t["inference_logprobs"], t["advantages"], mask, seq_ids, lcfg)
    # The entropy bonus acts only on the tokens the loss keeps; without it no gradient flows into the entropy.
    total = loss - lcfg.entropy_coef * (entropy * kept).sum() if lcfg.entropy_coef else loss
    (total / normalizer).backward()
    metrics["loss"] = loss.detach()
    metrics["entropy"] = (entropy.detach() * mask).sum()
    if routing is not None:
        metrics["router_disagree"] = torch.as_tensor(routing.num_disagree, dtype=torch.float32, device=lp.device)
        metrics["router_pairs"] = torch.as_tensor(routing.num_pairs, dtype=torch.float32, device=lp.device)
    return metrics


def _loss_token_logprobs(h_BTD: torch.Tensor, weight_VD: torch.Tensor, t: dict, chunk: int,
                         keep_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy ``[B, T]`` at the positions that score a loss token (0 elsewhere): the
    LM head runs on those only, never on prompt tokens. The positions come from the host copy of
    the loss mask, so selecting them costs no device sync."""
    targets = t["targets"]
    host_mask = t.get("host_loss_mask")
    if host_mask is None:
        lp, entropy = chunked_logprobs(h_BTD.flatten(0, 1), weight_VD, targets.flatten(), t["temperature"], chunk,
                                       t["top_p"], keep_logits)
        return lp.view(targets.shape), entropy.view(targets.shape)
    index = host_mask.flatten().nonzero()[:, 0].to(h_BTD.device, non_blocking=True)
    lp, entropy = chunked_logprobs(h_BTD.flatten(0, 1).index_select(0, index), weight_VD,
                                   targets.flatten().index_select(0, index), t["temperature"], chunk, t["top_p"],
                                   keep_logits)
    zeros = torch.zeros(targets.numel(), dtype=lp.dtype, device=lp.device)
    return zeros.index_add(0, index, lp).view(targets.shape), zeros.index_add(0, index, entropy).view(targets.shape)


def accumulate(model: torch.nn.Module, micro_batches: list[MicroBatch], dims, device: torch.device,
               loss_fn: Callable, lcfg, chunk: int, r3: bool = False, attention: str = "auto",
               reshard: str = "micro_batch", keep_logits: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """forward_backward over this rank's rows (padded to the busiest rank's count; cut to this
    rank's part of each row under context parallelism). Returns this rank's metric sums and
    the step's loss-token count (all-reduced over the dp ranks). The sums include
    ``tokens_unique`` (tokens the rows hold, each shared prompt once) and ``tokens_total``
    (the same samples packed unshared). ``attention``: train.attention; ``reshard``:
    train.parallel.reshard ("step": FSDP2 syncs gradients on the last row only);
    ``keep_logits``: train.logprob_keep_logits."""
    dp_group = dims.mesh["dp"].get_group() if dims.enabled else None
    normalizer = global_loss_tokens(micro_batches, device, dp_group)
    cp_rank = dims.coords(torch.distributed.get_rank())[1] if dims.enabled else 0
    totals: dict[str, torch.Tensor] = {}
    rows = padded_micro_batches(micro_batches, min_tokens=2 * dims.cp if dims.enabled else 2)
    for i, (mb, padding) in enumerate(rows):
        if reshard == "step":
            sync_gradients_on(model, last=i == len(rows) - 1)
        t, attn = prepare(mb, device, empty=padding), None
        if padding and r3 and "routed_experts" not in t:  # this rank holds no row: the filler has no routes
            t["routed_experts"] = filler_routes(model.args, t["input_ids"].shape[1], device)
            t["routes_range"] = (0, model.args.num_experts_per_tok - 1)
        if dims.cp > 1:
            from rlcli.parallel.context import shard_batch_for_cp

            host_pos = torch.from_numpy(mb.position_ids.numpy().astype("int64"))[None]
            t, attn = shard_batch_for_cp(t, cp_rank, dims.cp, attention, host_position_ids=host_pos, tree=t["tree"])
        metrics = forward_backward(model, t, normalizer, loss_fn, lcfg, chunk, attn, r3, attention, keep_logits)
        # The CP ranks of a row count its tokens once. Every rank reports both keys (0 for padding,
        # or a CP rank > 0): the step all-reduces one stacked tensor of the keys, which must match.
        counted = not padding and cp_rank == 0
        metrics["tokens_unique"] = torch.tensor(float(t["tree"].num_tokens) if counted else 0.0, device=device)
        metrics["tokens_total"] = torch.tensor(float(t["tree"].num_unshared_tokens()) if counted else 0.0,
                                               device=device)
        for k, v in metrics.items():
            if k.endswith("_max"):
                totals[k] = torch.maximum(totals[k], v) if k in totals else v
            else:
                totals[k] = totals.get(k, 0) + v
    return totals, normalizer


def global_loss_tokens(micro_batches: list[MicroBatch], device: torch.device, group=None) -> torch.Tensor:
    """Loss tokens of the whole step: this rank's count (host-side, from the batch file) summed
    over ``group`` (the data-parallel ranks) on device."""
    local = sum(int(mb.loss_mask.numpy()[1:].sum()) for mb in micro_batches)
    n = torch.tensor(float(local), device=device)
    return pdist.all_reduce_sum(n, group=group).clamp(min=1.0)


def padded_micro_batches(micro_batches: list[MicroBatch], min_tokens: int = 2) -> list[tuple[MicroBatch, bool]]:
    """(row, is_padding) pairs: as many as the busiest rank holds (one small collective). A rank
    that holds no row repeats a filler of ``min_tokens`` tokens (context parallelism cuts a row into
    2 x cp chunks: 2 x cp at least; every rank of a context-parallel group builds the same one)."""
    n = pdist.all_reduce_max_int(len(micro_batches))
    out = [(mb, False) for mb in micro_batches]
    if len(out) < n:
        filler = micro_batches[0] if micro_batches else _tiny_row(max(2, min_tokens))
        out += [(filler, True)] * (n - len(out))
    return out


def filler_routes(args, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Routes for a padding pass under R3 (``[tokens, MoE layers, k]``: experts 0..k-1 everywhere), for
    a rank that holds no row: under r3 every pass replays (and reports the router keys that the step
    all-reduces with the other ranks'); its loss mask is empty and it counts no route."""
    k = args.num_experts_per_tok
    return torch.arange(k, device=device).expand(num_tokens, args.num_moe_layers, k).contiguous()


def _tiny_row(n: int = 2) -> MicroBatch:
    import numpy as np

    from rlcli.protocol.messages import WireTensor

    T = WireTensor.from_numpy
    z = np.zeros(n, dtype=np.int32)
    return MicroBatch(input_ids=T(z), position_ids=T(np.arange(n, dtype=np.int32)),
                      loss_mask=T(np.zeros(n, dtype=np.bool_)), advantages=T(np.zeros(n, dtype=np.float32)),
                      inference_logprobs=T(np.zeros(n, dtype=np.float32)), versions=T(z))
