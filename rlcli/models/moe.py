"""Mixture-of-experts: router, grouped experts, and R3 routing record/replay.

The router picks ``top_k`` experts per token (softmax scores for Qwen3-MoE; sigmoid
scores with a selection-only bias and group-limited choice for the DeepSeek-V3
family). With a :class:`~rlcli.ops.attention.RoutingContext` it records the chosen ids,
or replays ids recorded elsewhere (by the inference engine): replayed tokens go to the
same experts, while their gate values are still computed from this router's scores,
so gradients reach the router through the gate values.

Experts are stored stacked, ``w_gate/w_up [E, I, D]`` and ``w_down [E, D, I]``, the
layout grouped GEMMs and expert parallelism shard along E; the checkpoint adapter maps
them to the per-expert tensors of the HF layout.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from rlcli.models.config import ModelArgs
from rlcli.models.layers import MLP
from rlcli.ops.attention import ForwardContext


def check_routes(routes_TLk, args: ModelArgs, num_tokens: int) -> None:
    """Refuse recorded routes that do not fit this model (another checkpoint, a wrong config)."""
    expected = (num_tokens, args.num_moe_layers, args.num_experts_per_tok)
    if tuple(routes_TLk.shape) != expected:
        raise ValueError(f"recorded routes have shape {tuple(routes_TLk.shape)} but this model needs {expected} "
                         "(tokens, MoE layers, experts per token): the engine served another model; set r3 = false "
                         "or serve the trained model")
    if routes_TLk.numel() and (int(routes_TLk.min()) < 0 or int(routes_TLk.max()) >= args.num_experts):
        raise ValueError(f"recorded routes name experts outside [0, {args.num_experts}): the engine served "
                         "another model; set r3 = false or serve the trained model")


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.num_experts_per_tok
        self.scoring = args.scoring_func
        self.norm_topk_prob = args.norm_topk_prob
        self.scaling = args.routed_scaling_factor
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        if self.scoring == "sigmoid":
            # Load-balancing bias: shifts which experts are chosen, never the gate values.
            self.register_buffer("e_score_correction_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def scores(self, x_ND: torch.Tensor) -> torch.Tensor:
        if self.scoring == "sigmoid":
            return F.linear(x_ND.float(), self.weight.float()).sigmoid()
        return F.softmax(F.linear(x_ND, self.weight), dim=-1, dtype=torch.float32)

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
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        w = w * self.scaling
        return w if self.scoring == "sigmoid" else w.to(dtype)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def forward(self, x_ND: torch.Tensor, idx_Nk: torch.Tensor, gates_Nk: torch.Tensor) -> torch.Tensor:
        N, k = idx_Nk.shape
        flat = idx_Nk.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // k
        x_sorted = x_ND[token]
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                xe = x_sorted[start:start + n]
                h = F.silu(xe @ self.w_gate[e].T) * (xe @ self.w_up[e].T)
                outs.append(h @ self.w_down[e].T)
            start += n
        y_sorted = torch.cat(outs) if outs else x_sorted.new_zeros(0, x_ND.shape[1])
        y_sorted = y_sorted * gates_Nk.reshape(-1)[order, None]
        out = torch.zeros_like(x_ND)
        return out.index_add_(0, token, y_sorted.to(out.dtype))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, moe_idx: int):
        super().__init__()
        self.moe_idx = moe_idx
        self.gate = Router(args)
        self.experts = GroupedExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_experts = (MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
                               if args.n_shared_experts else None)

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
                routing.num_disagree = routing.num_disagree + (differs & counted).sum()
                routing.num_pairs = routing.num_pairs + counted.sum()
        else:
            idx = self.gate.select(scores)
        if routing is not None and routing.record:
            routing.recorded.append(idx)
        out = self.experts(x, idx, self.gate.gates(scores, idx, x.dtype)).view(B, T, D)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_BTD)
        return out
