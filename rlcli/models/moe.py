"""Mixture-of-experts: router, grouped experts, and R3 routing record/replay.

The router picks ``top_k`` experts per token (softmax scores for Qwen3-MoE; sigmoid
scores with a selection-only bias and group-limited choice for the DeepSeek-V3
family). With a :class:`~rlcli.ops.attention.RoutingContext` it records the chosen ids,
or replays ids recorded elsewhere (by the inference engine): replayed tokens go to the
same experts, while their gate values are still computed from this router's scores,
so gradients reach the router through the gate values.

Experts are stored stacked, ``w_gate/w_up [E, I, D]`` and ``w_down [E, D, I]``, the
layout grouped GEMMs and expert parallelism shard along E; the checkpoint adapter maps
them to the per-expert tensors of the HF layout. The (token, expert) pairs are sorted by
expert and all experts run as one grouped GEMM per projection; per-expert counts stay on
the device, so a layer has no host sync (expert parallelism adds one, see
``rlcli.parallel.expert``).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from rlcli.models.config import ModelArgs
from rlcli.models.layers import MLP
from rlcli.ops.attention import ForwardContext
from rlcli.ops.batch_invariant import row_sum
from rlcli.ops.grouped_gemm import grouped_mm
from rlcli.ops.swiglu import swiglu


class _Dispatch(torch.autograd.Function):
    """``x[order // k]``: each token's ``k`` copies, sorted by expert (``order`` a permutation of the
    N*k (token, slot) pairs, ``inverse`` its inverse). Backward puts the copies' gradients back in
    (token, slot) order with the inverse permutation and sums each token's ``k``: a gather and a
    reduction, where autograd's ``index`` backward adds the copies one by one (with atomics on CUDA)."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, order_R: torch.Tensor, inverse_R: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse_R)
        ctx.k = k
        return x_ND.index_select(0, torch.div(order_R, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, g_RD: torch.Tensor):
        (inverse_R,) = ctx.saved_tensors
        g = g_RD.index_select(0, inverse_R)
        return g.view(-1, ctx.k, g.shape[-1]).sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """``x[index]`` for a permutation ``index`` whose inverse is ``inverse``; backward is the gather
    ``g[inverse]`` (no atomic adds: every row has one source). :func:`permute`."""

    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, index_R: torch.Tensor, inverse_R: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse_R)
        return x_RD.index_select(0, index_R)

    @staticmethod
    def backward(ctx, g_RD: torch.Tensor):
        (inverse_R,) = ctx.saved_tensors
        return g_RD.index_select(0, inverse_R), None, None


def permute(x_RD: torch.Tensor, index_R: torch.Tensor, inverse_R: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for a permutation ``index`` of the rows (``inverse``: its inverse), differentiable:
    the gradient is gathered back through ``inverse``, where autograd's backward of ``x[index]``
    accumulates into a zeroed tensor (atomic adds on CUDA)."""
    return _Permute.apply(x_RD, index_R, inverse_R)


def inverse_permutation(order_R: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``order`` (``x[order][inverse] == x``), on ``order``'s device."""
    inverse = torch.empty_like(order_R)
    inverse[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    return inverse


class _Combine(torch.autograd.Function):
    """``sum_j gates[:, j] * y[:, j]``, ``[N, D]`` from ``y [N, k, D]``: forward one batched product
    (accumulated in fp32, rounded once); backward the gates' gradient as batched dot products and
    ``y``'s as a broadcast multiply. (Autograd's own backward of that product is a GEMM with an
    inner dimension of 1, which cuBLAS runs at a fraction of the bandwidth.)"""

    @staticmethod
    def forward(ctx, y_NkD: torch.Tensor, gates_Nk: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y_NkD, gates_Nk)
        return torch.bmm(gates_Nk.unsqueeze(1), y_NkD).squeeze(1)

    @staticmethod
    def backward(ctx, g_ND: torch.Tensor):
        y_NkD, gates_Nk = ctx.saved_tensors
        g_ND = g_ND.contiguous()
        grad_y = gates_Nk[:, :, None] * g_ND[:, None, :] if ctx.needs_input_grad[0] else None
        grad_gates = torch.bmm(y_NkD, g_ND.unsqueeze(2)).squeeze(2) if ctx.needs_input_grad[1] else None
        return grad_y, grad_gates


def check_routes(routes_TLk, args: ModelArgs, num_tokens: int,
                 value_range: tuple[int, int] | None = None) -> None:
    """Refuse recorded routes that do not fit this model (another checkpoint, a wrong config).
    ``value_range``: their smallest and largest expert index, known on the host (else read from
    ``routes_TLk``, a device sync)."""
    expected = (num_tokens, args.num_moe_layers, args.num_experts_per_tok)
    if tuple(routes_TLk.shape) != expected:
        raise ValueError(f"recorded routes have shape {tuple(routes_TLk.shape)} but this model needs {expected} "
                         "(tokens, MoE layers, experts per token): the engine served another model; set r3 = false "
                         "or serve the trained model")
    if value_range is None and routes_TLk.numel():
        value_range = int(routes_TLk.min()), int(routes_TLk.max())
    if value_range is not None and (value_range[0] < 0 or value_range[1] >= args.num_experts):
        raise ValueError(f"recorded routes name experts outside [0, {args.num_experts}): the engine served "
                         "another model; set r3 = false or serve the trained model")


class Router(nn.Module):
    fp32_buffers = ("e_score_correction_bias",)
    """Kept fp32 in a model of any dtype (``build_model``), like the router's scores it shifts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.num_experts_per_tok
        self.scoring = args.scoring_func
        self.norm_topk_prob = args.norm_topk_prob
        self.scaling = args.routed_scaling_factor
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        if self.scoring == "sigmoid":
            # Load-balancing bias: shifts which experts are chosen, never the gate values. A buffer,
            # loaded from the checkpoint and fixed in RL: no gradient, and DeepSeek's auxiliary-loss-free
            # update of it (from expert load) is not run, so the routing balance is the checkpoint's.
            self.register_buffer("e_score_correction_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def logits(self, x_ND: torch.Tensor) -> torch.Tensor:
        """``x W^T`` (in fp32 for sigmoid scoring): the seam model.batch_invariant replaces."""
        if self.scoring == "sigmoid":
            return F.linear(x_ND.float(), self.weight.float())
        return F.linear(x_ND, self.weight)

    def scores(self, x_ND: torch.Tensor) -> torch.Tensor:
        if self.scoring == "sigmoid":
            return self.logits(x_ND).sigmoid()
        return F.softmax(self.logits(x_ND), dim=-1, dtype=torch.float32)

    def select(self, scores_NE: torch.Tensor) -> torch.Tensor:
        """Top-k expert ids [N, k]."""
        choice = scores_NE
        if self.e_score_correction_bias is not None:
            choice = scores_NE + self.e_score_correction_bias
        if self.n_group > 1:
            N = choice.shape[0]
            grouped = choice.view(N, self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False)[1], True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, -1)
        return choice.topk(self.top_k, dim=-1, sorted=self.scoring != "sigmoid")[1]

    def gates(self, scores_NE: torch.Tensor, idx_Nk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        w = scores_NE.gather(1, idx_Nk)
        if self.norm_topk_prob:  # row_sum: CUDA's sum over a short row follows the row count (batch_invariant)
            w = w / (row_sum(w)[:, None] + (1e-20 if self.scoring == "sigmoid" else 0.0))
        w = w * self.scaling
        return w if self.scoring == "sigmoid" else w.to(dtype)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()


class GroupedExperts(nn.Module):
    """Stacked SwiGLU experts over tokens already sorted by expert.

    ``forward(x_RD, num_tokens_per_expert_E)``: rows of ``x`` grouped by expert (expert 0's
    tokens first), with the per-expert counts as a device tensor; returns ``[R, D]`` in the
    same order. Each of the three projections is one grouped GEMM (``expert_mm``, the seam
    a quantized variant overrides). Expert parallelism shards ``E`` and wraps ``forward``
    from outside (``rlcli.parallel.expert``), so ``E`` here is the number of local experts.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def expert_mm(self, x_RK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        return grouped_mm(x_RK, w_ENK, offs_E)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RI = swiglu(self.expert_mm(x_RD, self.w_gate, offs), self.expert_mm(x_RD, self.w_up, offs))
        return self.expert_mm(h_RI, self.w_down, offs)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, moe_idx: int):
        super().__init__()
        self.moe_idx = moe_idx
        self.gate = Router(args)
        self.experts = GroupedExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size)
        self.num_experts = args.num_experts
        # Tokens routed to each expert since the last read (load-balance metrics); an
        # activation-checkpoint recompute counts again, which leaves the fractions unchanged. A
        # non-persistent buffer: not in checkpoints, and it moves with the model (``.cuda()``).
        self.register_buffer("num_tokens_per_expert", None, persistent=False)
        self.shared_experts = (MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
                               if args.n_shared_experts else None)

    def routed(self, x_ND: torch.Tensor, idx_Nk: torch.Tensor, gates_Nk: torch.Tensor) -> torch.Tensor:
        """Sort the N*k (token, expert) pairs by expert, run the experts, weight by the gates and
        sum back per token. Counts stay on the device (no bincount: on CUDA it syncs). The sort and
        its inverse are permutations, so dispatch and combine are gathers both ways: no atomic adds
        (``index_add_``), no zeroed buffers."""
        N, k = idx_Nk.shape
        flat = idx_Nk.reshape(-1)
        order = flat.argsort(stable=True)  # sorted row i is (token, slot) pair order[i]
        inverse = inverse_permutation(order)
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts_E.scatter_add_(0, flat, torch.ones_like(flat))
        with torch.no_grad():
            seen = self.num_tokens_per_expert
            self.num_tokens_per_expert = counts_E.detach().clone() if seen is None else seen + counts_E
        y_sorted = self.experts(_Dispatch.apply(x_ND, order, inverse, k), counts_E)
        return self.combine(permute(y_sorted, inverse, order).view(N, k, -1), gates_Nk).to(x_ND.dtype)

    def combine(self, y_NkD: torch.Tensor, gates_Nk: torch.Tensor) -> torch.Tensor:
        """Each token's ``k`` expert outputs (slot order) weighted by its gates and summed, ``[N, D]``
        (:class:`_Combine`). The seam model.batch_invariant replaces."""
        return _Combine.apply(y_NkD, gates_Nk.to(y_NkD.dtype))

    def forward(self, x_BTD: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(-1, D)
        scores = self.gate.scores(x)
        routing = ctx.routing
        if routing is not None and routing.replay is not None:
            idx = routing.replay[:, self.moe_idx].to(device=x.device, dtype=torch.long)
            with torch.no_grad():  # router disagreement: from the scores already computed, no second forward
                own = self.gate.select(scores.detach())
                differs = (own.sort(-1)[0] != idx.sort(-1)[0]).any(-1)
                counted = routing.counted if routing.counted is not None else torch.ones_like(differs)
                routing.tally.add((differs & counted).sum(), counted.sum())
        else:
            idx = self.gate.select(scores)
        if routing is not None and routing.record:
            routing.recorded.append(idx)
        out = self.routed(x, idx, self.gate.gates(scores, idx, x.dtype)).view(B, T, D)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_BTD)
        return out
