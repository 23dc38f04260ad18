"""Multi-head latent attention (MLA) in latent form, dense or DeepSeek-sparse (DSA).

MLA keys and values are up-projections of one per-token latent ``c`` (``kv_lora_rank``
values) plus one rotary key shared by all heads. Folding the key up-projection into the
query (``q_lat = q_nope @ W_UK``) turns attention into multi-query attention over the
cached ``kv = [c, k_rot]`` (576 values per token for DeepSeek-V3) with the latent ``c``
as the value; the value up-projection is applied after the weighted sum. So the paged
cache holds ``kv`` only, 71x less than expanded per-head K and V for DeepSeek-V3.

DSA adds a lightning indexer: ``score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])``
over all earlier tokens ``s`` of the same sequence, and query ``t`` attends to its
``index_topk`` best tokens only. :func:`select_topk` is the one selection rule for
training and inference: causal (keys ``lo[t]..hi[t]``), every allowed token when there
are at most ``topk`` of them, and exact ties at the cut broken towards the earlier token
(one float top-k finds the k-th score, a running count keeps the earliest tokens equal to
it), so the choice never depends on how the scores were chunked or padded. ``torch.topk``
alone breaks ties by memory layout. On CUDA the scores come from one fused Triton kernel
(:mod:`rlcli.ops.dsa_triton`) in training and in the engine alike.

Under context parallelism queries stay on their rank; :class:`SparseLatentAttention`
receives the whole row's latent KV and indexer keys from one all-gather per layer.

Long sequences never hold a ``[T, S]`` tensor of more than ``chunk`` query rows; under
autograd each chunk of torch sparse attention is checkpointed, so backward keeps only inputs
(the Triton kernel saves its output and log-sum-exp and never gathers).
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlcli.ops import dsa_triton
from rlcli.ops.attention import InnerAttention, PagedAttention
from rlcli.ops.batch_invariant import invariant_attention, row_sum

# Query rows per chunk are sized so that the chunk's largest intermediate (indexer scores
# [rows, Hi, S], gathered latents [rows, k, L]) stays near this many elements: on CUDA a
# large budget (few chunks: each costs a host sync and kernel launches; at 131k tokens the
# CPU budget would mean 32-row chunks), on the CPU a small one.
CHUNK_ELEMENTS = 1 << 26
CUDA_CHUNK_ELEMENTS = 1 << 31
_POS_BITS = 21  # tie-break positions within one key window: up to 2M tokens
# Triton kernels (indexer scores, sparse attention): None uses them on CUDA when triton
# imports; True also on CPU under TRITON_INTERPRET=1 (tests); False never. Engine and trainer
# read the same switch, so they compute the same scores and selection.
TRITON: bool | None = None


def _chunk(per_row: int, device: torch.device) -> int:
    budget = CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS
    return max(1, budget // max(1, per_row))


def _topk_earliest(scores_TW: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending) of the k largest scores per row, exact ties at the cut going to the
    smaller index: one float top-k finds the k-th value, then every larger score and the
    earliest of the scores equal to it (a running count) are kept, listed by ``nonzero`` (its
    count read on the host). Scores must not be NaN. The engine's decodes choose by the same rule
    with no host sync in :func:`rlcli.ops.dsa_triton.topk_rows`."""
    kth_T1 = scores_TW.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores_TW > kth_T1
    tied = scores_TW == kth_T1  # -0.0 == +0.0, as in the reference's comparisons
    need_T1 = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    take = above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= need_T1))
    return take.nonzero()[:, 1].view(-1, k)


def _topk_earliest_int64(scores_TW: torch.Tensor, k: int) -> torch.Tensor:
    """The same choice as :func:`_topk_earliest` by a top-k over an int64 key (score bits, then
    reversed position); slower on long rows. Kept as the rule's independent reference."""
    W = scores_TW.shape[-1]
    assert W < 1 << _POS_BITS, "key window too long for the tie-break key"
    bits = (scores_TW + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 makes -0.0 equal +0.0
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # float order as integer order
    rank = ((1 << _POS_BITS) - 1) - torch.arange(W, device=scores_TW.device)
    return ((bits << _POS_BITS) | rank).topk(k, dim=-1).indices


def _fused_scores(q_THD: torch.Tensor) -> bool:
    use = q_THD.is_cuda if TRITON is None else TRITON
    return use and dsa_triton.available(q_THD) and dsa_triton.scores_supported(q_THD.shape[-1])


@torch.no_grad()
def index_scores(q_THD: torch.Tensor, w_TH: torch.Tensor, k_SD: torch.Tensor, scale: float,
                 invariant: bool = False) -> torch.Tensor:
    """Lightning-indexer scores [T, S] in fp32; keys are shared ``[S, D]`` or per query
    ``[T, S, D]``. With Triton (:data:`TRITON`) one fused kernel computes each score from its
    own query and key only (the same kernel for shared and per-query keys); otherwise torch in
    the order of operations of the reference, or with ``invariant`` (``model.batch_invariant``)
    in a fixed order: each head's products summed over the head dim (one fixed-length
    reduction per score, :func:`rlcli.ops.batch_invariant.row_sum`), then the heads' weighted
    scores added in head order, so a score's bits do not depend on how many queries or keys
    share the call (the fused kernel's do not either)."""
    if _fused_scores(q_THD):
        return dsa_triton.index_scores(q_THD, w_TH, k_SD, scale)
    if invariant:
        k = k_SD.float()
        k = k[None] if k.dim() == 2 else k  # [1 or T, S, D]
        q, w = q_THD.float(), w_TH.float()
        T, S, D = q.shape[0], k.shape[-2], q.shape[-1]
        out = None
        for h in range(q.shape[1]):
            s_TS = row_sum((q[:, h, None, :] * k).view(T * S, D)).view(T, S).mul_(scale).relu_().mul_(w[:, h, None])
            out = s_TS if out is None else out.add_(s_TS)
        return out
    k_DS = k_SD.float().transpose(-1, -2)
    # Shared keys broadcast (one GEMM for all queries and heads); per-query keys batch over queries.
    s_THS = torch.matmul(q_THD.float(), k_DS[None] if k_SD.dim() == 2 else k_DS)
    s_THS.mul_(scale).relu_()  # in place: the largest tensor of the step is written once
    return torch.matmul(w_TH.float()[:, None, :], s_THS)[:, 0]


@torch.no_grad()
def select_topk(q_THD: torch.Tensor, w_TH: torch.Tensor, k_SD: torch.Tensor, lo_T: torch.Tensor,
                hi_T: torch.Tensor, topk: int, scale: float, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k keys per query among keys ``lo[t] <= s <= hi[t]``: (indices [T, k], valid [T, k]),
    ``k = min(topk, S)``; a query with fewer allowed keys gets all of them (rest invalid).
    Keys are shared ``[S, D]`` or per query ``[T, S, D]`` (a padded decode batch). Each chunk
    of queries scores only the key window its rows can see (one host sync per chunk).

    Indices ascend; ``invariant`` (``model.batch_invariant``) scores in :func:`index_scores`'
    fixed order and puts the valid entries first (then the invalid ones), so a query's chosen
    tokens sit in the same slots whatever its window's offset in the row and whatever ``k``."""
    T, S = q_THD.shape[0], k_SD.shape[-2]
    k = min(topk, S)
    idx_Tk = torch.zeros(T, k, dtype=torch.long, device=q_THD.device)
    valid_Tk = torch.zeros(T, k, dtype=torch.bool, device=q_THD.device)
    # The torch scores hold [rows, Hi, S] (invariant: [rows, S, Di]); the fused kernel only the
    # [rows, S] scores and the top-k's temporaries (~16 bytes per score).
    fused = _fused_scores(q_THD)
    step = _chunk((16 if fused else q_THD.shape[-1] if invariant else q_THD.shape[1]) * S, q_THD.device)
    for a in range(0, T, step):
        b = min(a + step, T)
        first, last = int(lo_T[a:b].min()), int(hi_T[a:b].max()) + 1
        keys = k_SD[first:last] if k_SD.dim() == 2 else k_SD[a:b, first:last]
        scores = index_scores(q_THD[a:b], w_TH[a:b], keys, scale, invariant)
        pos_W = torch.arange(first, last, device=q_THD.device)
        allowed = (pos_W[None] >= lo_T[a:b, None]) & (pos_W[None] <= hi_T[a:b, None])
        scores = scores.masked_fill(~allowed, float("-inf"))
        kk = min(k, last - first)
        order = _topk_earliest(scores, kk)
        keep = allowed.gather(1, order)
        if invariant:  # valid entries first, each group still ascending
            first_valid = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)
            order, keep = order.gather(1, first_valid), keep.gather(1, first_valid)
        idx_Tk[a:b, :kk] = (order + first).masked_fill(~keep, 0)  # invalid entries point at token 0
        valid_Tk[a:b, :kk] = keep
    return idx_Tk, valid_Tk


def paged_select_topk(q_THD: torch.Tensor, w_TH: torch.Tensor, k_cache_SD: torch.Tensor, tables_TW: torch.Tensor,
                      lens_T: torch.Tensor, block_size: int, topk: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_topk` for the engine's decodes, each query among its own context's keys
    (``lo = 0``, ``hi = lens - 1``), the keys read in place from the paged index cache (the Triton
    kernel, :func:`rlcli.ops.dsa_triton.paged_index_scores`): (positions [T, topk], valid [T, topk]),
    always ``topk`` wide (a context shorter than that gets all its tokens, then invalid entries at
    position 0), chosen by the same rule (:func:`rlcli.ops.dsa_triton.topk_rows`) with no host sync,
    so a CUDA graph holds it; the choice reads each context's scores only, not the table's width."""
    width = max(tables_TW.shape[1] * block_size, topk)
    scores = dsa_triton.paged_index_scores(q_THD, w_TH, k_cache_SD, tables_TW, lens_T, block_size, scale, width)
    idx = dsa_triton.topk_rows(scores, lens_T, topk)
    valid = idx < lens_T[:, None]
    return idx.masked_fill(~valid, 0), valid


def dsa_decodes_in_place(args, x: torch.Tensor) -> bool:
    """Whether an engine's DSA decodes run on ``x``'s device through the Triton kernels alone
    (:func:`paged_select_topk`, then sparse attention by cache slot), with no host sync: the
    kernels switched on (:data:`TRITON`) and importable, and the model's widths fitting them."""
    return ((x.is_cuda if TRITON is None else TRITON) and dsa_triton.available(x)
            and dsa_triton.scores_supported(args.index_head_dim)
            and dsa_triton.attention_supported(args.kv_lora_rank, args.qk_rope_head_dim))


def tree_key_layout(tree, rows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, ...]:
    """For :func:`select_topk_tree`: a shared-prompt row's (:class:`~rlcli.ops.prefix_tree.RowTree`)
    keys laid out as the unshared rows hold them (per segment with queries: its ancestors root
    first, then the segment, up to its last query), as row indices, and each query's window
    ``lo..hi`` in that layout. ``rows``: the queries' row indices. The same for every layer."""
    seg_T = tree.segment_ids()[rows]
    lo_T, hi_T = np.empty(len(rows), dtype=np.int64), np.empty(len(rows), dtype=np.int64)
    layout, offset = [], 0
    for j in np.unique(seg_T).tolist():
        start = tree.spans[j][0]
        (queries,) = np.nonzero(seg_T == j)
        end = int(rows[queries].max()) + 1  # the segment's later tokens are nobody's key here
        doc = np.concatenate([np.arange(a, b) for a, b in tree.ancestors(j) + [(start, end)]])
        lo_T[queries] = offset
        hi_T[queries] = offset + len(doc) - end + rows[queries]  # the query's own place in doc
        layout.append(doc)
        offset += len(doc)
    return tuple(torch.from_numpy(x).to(device) for x in (np.concatenate(layout), lo_T, hi_T))


def select_topk_tree(q_THD: torch.Tensor, w_TH: torch.Tensor, k_SD: torch.Tensor, layout: tuple[torch.Tensor, ...],
                     topk: int, scale: float, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_topk` over a shared-prompt row: query ``t`` chooses among its segment's
    ancestors and the earlier tokens of its own segment, the tokens its unshared row shows it.
    Over the keys in :func:`tree_key_layout`'s order, scores, windows and tie-breaks are the
    unshared row's, all in one :func:`select_topk`; the chosen indices are then mapped back to
    row indices (still ascending, within the valid entries and the invalid ones under ``invariant``:
    ancestors come first in the row too). Keys ``[S, D]`` are the
    whole row's."""
    key_rows, lo_T, hi_T = layout
    idx, valid = select_topk(q_THD, w_TH, k_SD[key_rows], lo_T, hi_T, topk, scale, invariant)
    return key_rows[idx].masked_fill(~valid, 0), valid  # invalid entries point at token 0


def _attend(q_CHL, kv_CkL, valid_Ck, value_dim: int, scale: float) -> torch.Tensor:
    """Each query row over its own keys ``kv[c]`` (the first ``value_dim`` features are the value)."""
    s_CHk = torch.einsum("chl,ckl->chk", q_CHL, kv_CkL).float() * scale
    p_CHk = torch.softmax(s_CHk.masked_fill(~valid_Ck[:, None], float("-inf")), dim=-1).to(q_CHL.dtype)
    return torch.einsum("chk,ckr->chr", p_CHk, kv_CkL[..., :value_dim])


def _sparse_chunk(q_CHL, kv_SL, idx_Ck, valid_Ck, value_dim: int, scale: float) -> torch.Tensor:
    return _attend(q_CHL, kv_SL[idx_Ck], valid_Ck, value_dim, scale)


def _over_query_chunks(chunk_fn, step: int, q_THL, kv_SL, idx_Tk, valid_Tk, value_dim: int, scale: float):
    """``chunk_fn`` over chunks of ``step`` queries, each checkpointed under autograd (backward keeps
    only the inputs, not the chunk's gathered tokens)."""
    T = q_THL.shape[0]
    if T <= step:
        return chunk_fn(q_THL, kv_SL, idx_Tk, valid_Tk, value_dim, scale)
    outs = []
    for a in range(0, T, step):
        args = (q_THL[a:a + step], kv_SL, idx_Tk[a:a + step], valid_Tk[a:a + step], value_dim, scale)
        if torch.is_grad_enabled() and (q_THL.requires_grad or kv_SL.requires_grad):
            outs.append(checkpoint(chunk_fn, *args, use_reentrant=False))
        else:
            outs.append(chunk_fn(*args))
    return torch.cat(outs)


def sparse_latent_attention(q_THL: torch.Tensor, kv_SL: torch.Tensor, idx_Tk: torch.Tensor, valid_Tk: torch.Tensor,
                            value_dim: int, scale: float) -> torch.Tensor:
    """Attention of each query over its selected latent tokens only: [T, H, value_dim]."""
    step = _chunk(idx_Tk.shape[1] * kv_SL.shape[-1], kv_SL.device)
    return _over_query_chunks(_sparse_chunk, step, q_THL, kv_SL, idx_Tk, valid_Tk, value_dim, scale)


def _invariant_sparse_chunk(q_CHL, kv_SL, idx_Ck, valid_Ck, value_dim: int, scale: float) -> torch.Tensor:
    kv_C1kL = kv_SL[idx_Ck][:, None]
    return invariant_attention(q_CHL[:, :, None], kv_C1kL, kv_C1kL[..., :value_dim], scale, valid_Ck.sum(1))[:, :, 0]


def invariant_sparse_attention(q_THL: torch.Tensor, kv_SL: torch.Tensor, idx_Tk: torch.Tensor, valid_Tk: torch.Tensor,
                               value_dim: int, scale: float) -> torch.Tensor:
    """:func:`sparse_latent_attention` under ``model.batch_invariant`` (off CUDA): each query's chosen
    tokens, valid first (``select_topk(invariant=True)``), as a short sequence of its own through
    :func:`rlcli.ops.batch_invariant.invariant_attention`, whose fixed key blocks make the padding
    past a query's last valid token add exact zeros; so the bits do not depend on ``k``, on the
    valid tokens' positions or on the other queries. ``idx`` indexes ``kv``'s rows (the engine
    passes cache slots). Checkpointed per query chunk under autograd."""
    _, H, L = q_THL.shape
    step = _chunk(H * idx_Tk.shape[1] * (L + 1), kv_SL.device)
    return _over_query_chunks(_invariant_sparse_chunk, step, q_THL, kv_SL, idx_Tk, valid_Tk, value_dim, scale)


def dense_latent_attention(q_THL: torch.Tensor, kv_SL: torch.Tensor, value_dim: int, scale: float,
                           mask_TS: torch.Tensor | None) -> torch.Tensor:
    """Multi-query attention over the latent (one shared key/value head): [T, H, value_dim]."""
    q = q_THL.transpose(0, 1)[None]  # [1, H, T, L]
    k = kv_SL[None, None]  # [1, 1, S, L]
    v = kv_SL[None, None, :, :value_dim]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_TS, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _masked_chunk(q_CHD, k_SHD, v_SHV, idx_Ck, valid_Ck, scale: float) -> torch.Tensor:
    C, S = q_CHD.shape[0], k_SHD.shape[0]
    mask = torch.zeros(C, S + 1, dtype=torch.bool, device=q_CHD.device)
    mask.scatter_(1, idx_Ck.masked_fill(~valid_Ck, S), True)  # invalid entries land in the extra column
    out = F.scaled_dot_product_attention(q_CHD.transpose(0, 1)[None], k_SHD.transpose(0, 1)[None],
                                         v_SHV.transpose(0, 1)[None], attn_mask=mask[None, None, :, :S], scale=scale)
    return out[0].transpose(0, 1)


def masked_dense_attention(q_THD: torch.Tensor, k_SHD: torch.Tensor, v_SHV: torch.Tensor, idx_Tk: torch.Tensor,
                           valid_Tk: torch.Tensor, rows_T: torch.Tensor, scale: float) -> torch.Tensor:
    """The sparse selection as a boolean mask over expanded keys, per query chunk (keys up to
    the chunk's last row only); each chunk is checkpointed, so only indices are saved."""
    T = q_THD.shape[0]
    step = _chunk(8 * k_SHD.shape[0], k_SHD.device)
    outs = []
    for a in range(0, T, step):
        last = int(rows_T[a:a + step].max()) + 1
        args = (q_THD[a:a + step], k_SHD[:last], v_SHV[:last], idx_Tk[a:a + step], valid_Tk[a:a + step], scale)
        if torch.is_grad_enabled() and q_THD.requires_grad:
            outs.append(checkpoint(_masked_chunk, *args, use_reentrant=False))
        else:
            outs.append(_masked_chunk(*args))
    return torch.cat(outs)


# ------------------------------------------------------------------------------ packed rows (training)

# Training kernel for DSA. MASKED_DENSE = True: the top-k as a boolean mask for SDPA over
# expanded K/V (dense work; kept for comparison). Otherwise the gathered sparse kernel:
# Triton (dsa_triton.sparse_attention) where TRITON allows it and the latent widths suit it,
# else torch (sparse_latent_attention).
MASKED_DENSE: bool | None = None


@dataclass
class LatentQuery:
    """A DSA layer's local queries: absorbed MLA queries and, for a layer with its own
    indexer, the indexer's queries and head weights (None on a "shared" layer, which reads
    ``ctx.dsa_selection[source_layer]``)."""

    q_BTHL: torch.Tensor
    value_dim: int
    source_layer: int  # the indexer layer whose choice this layer uses (itself, if it has one)
    w_uv_HVR: torch.Tensor  # value up-projection: latent output -> per-head values
    q_BTHD: torch.Tensor  # the same queries expanded (nope + rope), for the masked dense kernel
    expand_kv: object  # kv [S, L] -> (k [S, H, D], v [S, H, V]): the layer's up-projection
    expand_out: object  # (out [B, T, H, R], w_uv [H, V, R]) -> [B, T, H, V]: the layer's value up-projection
    index_q_BTHD: torch.Tensor | None = None
    index_w_BTH: torch.Tensor | None = None
    topk: int = 0
    index_scale: float = 1.0
    invariant: bool = False  # model.batch_invariant: select_topk(invariant=True), invariant sparse attention


def sparse_kernel(kv: torch.Tensor, value_dim: int) -> bool:
    """Whether DSA's sparse attention over ``kv`` runs the Triton kernel (trainer and engine alike)."""
    return (kv.is_cuda if TRITON is None else TRITON) and dsa_triton.available(kv) and \
        dsa_triton.attention_supported(value_dim, kv.shape[-1] - value_dim)


class SparseLatentAttention(InnerAttention):
    """DSA over packed training rows, in latent form: ``forward(query: LatentQuery,
    kv [B, S, 1, L], index_keys [B, S, 1, Di], scale, ctx) -> [B, T, H, value_dim]``.

    Three kernels for the same function: the Triton gathered kernel (CUDA default, reads
    each query's selected latent rows in place), gathering the selected latents in torch per
    checkpointed chunk (CPU; the reference), or, with ``MASKED_DENSE``, SDPA over expanded
    K/V with the top-k as a boolean mask per query chunk (dense work; for comparison). With
    ``query.invariant`` (``model.batch_invariant``) the top-k is :func:`select_topk`'s invariant
    one and the CPU kernel :func:`invariant_sparse_attention`.

    Query ``t`` (row index ``r_t``, position ``p_t``) chooses among tokens ``r_t - p_t ..
    r_t`` of its own document; in a shared-prompt row, among the tokens its unshared row
    would show it, its segment's ancestors and its own earlier tokens (:func:`select_topk_tree`, over a
    key layout built once per forward).
    As an :class:`InnerAttention`, context parallelism's
    pre-hook (:func:`rlcli.parallel.context.apply_cp`) all-gathers ``kv`` and
    ``index_keys`` in one collective per layer (S is then the whole row, in row order,
    causally load-balanced chunks put back in place) while queries stay local, their row
    indices in ``ctx.attn.query_index``; top-k runs over the whole row, and the gather's
    backward (a reduce-scatter) returns each rank its keys' gradients."""

    def forward(self, query: LatentQuery, kv_BS1L: torch.Tensor, index_keys_BS1D: torch.Tensor, scale: float,
                ctx) -> torch.Tensor:
        B, T = query.q_BTHL.shape[:2]
        device = kv_BS1L.device
        rows = getattr(ctx.attn, "query_index", None)
        rows_T = rows.to(device) if rows is not None else torch.arange(T, device=device)
        trees = getattr(ctx.attn, "trees", None) if getattr(ctx.attn, "shared", False) else None
        own = query.index_q_BTHD is not None
        selections = [] if own else ctx.dsa_selection[query.source_layer]
        masked = bool(MASKED_DENSE)
        fused = sparse_kernel(kv_BS1L, query.value_dim)
        inv = query.invariant
        outs = []
        for b in range(B):
            if own and trees is not None and trees[b].shared:
                if b not in ctx.dsa_layouts:
                    ctx.dsa_layouts[b] = tree_key_layout(trees[b], rows.numpy() if rows is not None else np.arange(T),
                                                         device)
                selections.append(select_topk_tree(query.index_q_BTHD[b], query.index_w_BTH[b],
                                                   index_keys_BS1D[b, :, 0], ctx.dsa_layouts[b], query.topk,
                                                   query.index_scale, inv))
            elif own:
                lo_T = rows_T - ctx.position_ids[b]
                selections.append(select_topk(query.index_q_BTHD[b], query.index_w_BTH[b], index_keys_BS1D[b, :, 0],
                                              lo_T, rows_T, query.topk, query.index_scale, inv))
            idx, valid = selections[b]
            if masked:
                k_SHD, v_SHV = query.expand_kv(kv_BS1L[b, :, 0])
                outs.append(masked_dense_attention(query.q_BTHD[b], k_SHD, v_SHV, idx, valid, rows_T, scale))
            else:
                attend = dsa_triton.sparse_attention if fused else \
                    invariant_sparse_attention if inv else sparse_latent_attention
                out_THR = attend(query.q_BTHL[b], kv_BS1L[b, :, 0], idx, valid, query.value_dim, scale)
                outs.append(query.expand_out(out_THR[None], query.w_uv_HVR)[0])
        ctx.dsa_selection[query.source_layer] = selections
        return torch.stack(outs)


# ------------------------------------------------------------------------------ paged (inference)


def paged_latent_attention(attn: PagedAttention, layer_idx: int, q_NHL: torch.Tensor, kv_NL: torch.Tensor,
                           value_dim: int, scale: float, indexer=None, selection=None):
    """One engine step of latent MLA over the paged cache of ``attn``.

    The layer's cache is ``(kv_cache [blocks, block_size, 1, L],)`` plus, for a DSA layer with its
    own indexer, ``index_cache [blocks, block_size, 1, Di]``. ``indexer`` is ``(q [N, Hi, Di],
    w [N, Hi], k [N, Di], topk, scale)`` for such a layer; a layer that shares an earlier
    layer's choice passes that layer's ``selection`` instead. The decoding sequences (one
    query each) are attended in one batch (dense MLA with the engine's ``paged_decode``: the
    paged decode kernel, one latent K/V head read in place; else padded and gathered), prefill
    chunks one by one; a DSA layer reads only its chosen tokens, by cache slot, with the training
    kernel (the Triton one on CUDA), its decodes (with ``paged_decode`` and the Triton kernels)
    choosing them through :func:`paged_select_topk` without the host. Returns
    ``(out [N, H, value_dim], selection)``: (the decode batch's, [each prefill's]) (token
    indices, valid), or None for dense MLA.
    """
    meta = attn.meta
    caches = attn.kv_caches[layer_idx]
    kv_flat = caches[0].view(-1, caches[0].shape[-1])
    kv_flat.index_copy_(0, meta.slot_mapping, kv_NL.to(kv_flat.dtype))
    ik_flat = None
    if indexer is not None:
        iq_NHD, iw_NH, ik_ND, topk, iscale = indexer
        ik_flat = caches[1].view(-1, caches[1].shape[-1])
        ik_flat.index_copy_(0, meta.slot_mapping, ik_ND.to(ik_flat.dtype))
    sparse = indexer is not None or selection is not None
    inv = attn.batch_invariant
    if inv and not sparse:  # the GQA path's fixed order, one latent K/V head
        return attn.attend(q_NHL, caches[0], caches[0][..., :value_dim], scale), None
    # DSA reads only the chosen tokens, from the cache by slot, with the trainer's kernel: the Triton
    # one where it runs (CUDA), else torch's (under the flag invariant_sparse_attention).
    attend_chosen = None if not sparse else dsa_triton.sparse_attention if sparse_kernel(kv_flat, value_dim) \
        else invariant_sparse_attention if inv else sparse_latent_attention
    D, outs, decode_sel, prefill_sel = meta.num_decode, [], None, []
    latent_v = caches[0][..., :value_dim]
    if D and not sparse and attn.decodes_in_place(q_NHL, caches[0], latent_v):  # dense MLA: the kernel, in place
        outs.append(attn.paged_decode_step(q_NHL[:D], caches[0], latent_v, scale))
    elif D and sparse and not inv and attn.paged_decode and attend_chosen is dsa_triton.sparse_attention and \
            (indexer is None or _fused_scores(iq_NHD)):
        # The engine's kernels (infer.engine.paged_decode): keys scored and chosen tokens read in place
        # by block table and cache slot, in shapes set by the table's width (graphs: max_model_len).
        lens_D, bs = attn.decode_lens(q_NHL.device), meta.block_size
        tables = meta.block_tables[:D]
        decode_sel = (paged_select_topk(iq_NHD[:D], iw_NH[:D], ik_flat, tables, lens_D, bs, topk, iscale)
                      if indexer is not None else selection[0])
        idx_Dk, keep_Dk = decode_sel
        slots_Dk = tables.gather(1, idx_Dk // bs).clamp(min=0) * bs + idx_Dk % bs
        counts = lens_D.clamp(max=idx_Dk.shape[1])  # valid entries come first: the kernel reads no further
        outs.append(attend_chosen(q_NHL[:D], kv_flat, slots_Dk, keep_Dk, value_dim, scale, counts))
    elif D:
        lens = meta.context_lens[:D]
        pos_L = torch.arange(max(lens), device=kv_flat.device)
        hi_D = torch.tensor(lens, device=kv_flat.device) - 1
        blocks = meta.block_tables[:D, pos_L // meta.block_size].clamp(min=0)
        slots_DL = blocks * meta.block_size + pos_L % meta.block_size
        valid_DL = pos_L[None] <= hi_D[:, None]
        if indexer is not None:
            decode_sel = select_topk(iq_NHD[:D], iw_NH[:D], ik_flat[slots_DL], torch.zeros_like(hi_D), hi_D, topk,
                                     iscale, inv)
        elif selection is not None:
            decode_sel = selection[0]
        if decode_sel is not None:  # invalid entries point at the sequence's token 0 (a finite value)
            idx_Dk, keep_Dk = decode_sel
            outs.append(attend_chosen(q_NHL[:D], kv_flat, slots_DL.gather(1, idx_Dk), keep_Dk, value_dim, scale))
        else:
            # Padding slots hold other sequences' (or stale, non-finite) values: zero them.
            kv_DLL = kv_flat[slots_DL].masked_fill(~valid_DL[..., None], 0)
            outs.append(_attend(q_NHL[:D], kv_DLL, valid_DL, value_dim, scale))
    for j, i in enumerate(range(D, len(meta.context_lens))):
        n, a, b = meta.context_lens[i], meta.query_start[i], meta.query_start[i + 1]
        pos = torch.arange(n, device=kv_flat.device)
        slots = meta.block_tables[i, pos // meta.block_size] * meta.block_size + pos % meta.block_size
        hi_T = torch.arange(n - (b - a), n, device=kv_flat.device)
        sel = None
        if indexer is not None:
            sel = select_topk(iq_NHD[a:b], iw_NH[a:b], ik_flat[slots], torch.zeros_like(hi_T), hi_T, topk, iscale,
                              inv)
        elif selection is not None:
            sel = selection[1][j]
        prefill_sel.append(sel)
        if sel is not None:
            outs.append(attend_chosen(q_NHL[a:b], kv_flat, slots[sel[0]], sel[1], value_dim, scale))
        else:
            mask = pos[None] <= hi_T[:, None] if b - a > 1 else None
            outs.append(dense_latent_attention(q_NHL[a:b], kv_flat[slots], value_dim, scale, mask))
    return torch.cat(outs), ((decode_sel, prefill_sel) if sparse else None)
