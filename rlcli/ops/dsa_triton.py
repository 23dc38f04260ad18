"""Triton kernels for DeepSeek Sparse Attention on CUDA: fused lightning-indexer scores and
gathered sparse latent attention (forward and backward).

``index_scores``: ``score[t, s] = sum_h w[t, h] * relu(scale * q[t, h] . k[s])`` for a block
of queries x a block of keys per program, heads summed in registers, so the ``[T, Hi, S]``
intermediate of the torch path never reaches memory. Each score is computed from its own
query and key only (fixed loop order over heads, one dot over the head dim), whatever block,
chunk or window it falls in; ``bench/dsa_attention.py`` checks on the GPU that the bits do not
change with the block (Triton's CPU interpreter uses numpy's matmul, whose sums do).

``paged_index_scores``: the same scores for the engine's decoding sequences, each against its own
context's keys read in place from the paged index cache by block table (no gathered copy), in
shapes fixed by the table's width (the decode graphs', rlcli.infer.cuda_graphs); ``topk_rows``
chooses among them reading each row up to its context length only.

``sparse_attention``: one program per (query, head block) walks the query's selected token
indices in blocks, loads those tokens' latent rows ``[c, k_rot]`` straight from ``kv`` (no
gathered copy in memory) and runs an online softmax; the value is the latent ``c``. The
backward recomputes the probabilities from the saved log-sum-exp, accumulates the query
gradient in registers and adds each selected token's key/value gradient into an fp32 buffer
with atomics. Feature widths are padded to powers of two (masked loads).

Triton is optional: :func:`available` says whether the kernels can run on a tensor. Under
``TRITON_INTERPRET=1`` they run on CPU tensors (the tests).
"""

import functools
import importlib.util
import os

import torch


@functools.cache
def _kernels():
    """The kernels module, or None where Triton does not import."""
    try:
        from rlcli.ops import dsa_triton_kernels
    except (ImportError, OSError):
        return None
    return dsa_triton_kernels


@functools.cache
def installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(x: torch.Tensor) -> bool:
    """Whether the kernels can run on ``x`` (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    return installed() and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and _kernels() is not None


def _padded(n: int) -> int:
    """Block width for a feature dimension: the next power of two, at least 16 (tl.dot)."""
    return max(16, 1 << (n - 1).bit_length())


def attention_supported(rank: int, rope_dim: int) -> bool:
    """Latent and rope widths whose padded blocks fit one program (DeepSeek: 512 + 64)."""
    return _padded(rank) <= 512 and _padded(rope_dim) <= 128


def scores_supported(head_dim: int) -> bool:
    return _padded(head_dim) <= 256


def _precision(x: torch.Tensor) -> str:
    """fp32 products as torch would make them (tf32 only where torch allows it)."""
    return "tf32" if x.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"


@torch.no_grad()
def index_scores(q_THD: torch.Tensor, w_TH: torch.Tensor, k_SD: torch.Tensor, scale: float) -> torch.Tensor:
    """Indexer scores [T, S] in fp32 for shared keys ``[S, D]`` or per-query keys ``[T, S, D]``
    (one fused kernel; a query's scores are the same arithmetic either way)."""
    T, Hi, D = q_THD.shape
    S = k_SD.shape[-2]
    q = q_THD if q_THD.stride(-1) == 1 else q_THD.contiguous()
    k = k_SD.to(q.dtype).contiguous()
    w = w_TH.float().contiguous()
    out = torch.empty(T, S, dtype=torch.float32, device=q.device)
    BT, BS = 64, 128
    rows = BT if k.dim() == 2 else 1
    grid = (_cdiv(S, BS), _cdiv(T, rows))
    _kernels()._index_scores_kernel[grid](
        q, w, k, out, T, S, scale, q.stride(0), q.stride(1), w.stride(0), 0 if k.dim() == 2 else k.stride(0),
        k.stride(-2), out.stride(0), HI=Hi, DI=D, DP=_padded(D), ROWS=rows, BT=BT, BS=BS, PREC=_precision(q),
        num_warps=4)
    return out


@torch.no_grad()
def paged_index_scores(q_THD: torch.Tensor, w_TH: torch.Tensor, k_cache_SD: torch.Tensor, tables_TW: torch.Tensor,
                       lens_T: torch.Tensor, block_size: int, scale: float, width: int) -> torch.Tensor:
    """Indexer scores [T, width] in fp32 of T decoding sequences (one query each) against the keys
    of their contexts, read in place from the paged index cache ``[slots, D]`` through their block
    tables ``[T, W]``; positions at or past each context length ``lens_T`` score -inf. No host sync
    and no shape that varies with the context lengths: a CUDA graph holds it."""
    T, Hi, D = q_THD.shape
    assert k_cache_SD.dtype == q_THD.dtype and k_cache_SD.stride(-1) == 1, "index cache and queries differ"
    q = q_THD if q_THD.stride(-1) == 1 else q_THD.contiguous()
    w = w_TH.float().contiguous()
    out = torch.empty(T, width, dtype=torch.float32, device=q.device)
    BS = 128
    _kernels()._paged_index_scores_kernel[(_cdiv(width, BS), T)](
        q, w, k_cache_SD, tables_TW, lens_T, out, width, scale, q.stride(0), q.stride(1), w.stride(0),
        k_cache_SD.stride(0), tables_TW.stride(0), out.stride(0), HI=Hi, DI=D, DP=_padded(D), BT=16, BS=BS,
        BLOCK=block_size, PREC=_precision(q), num_warps=4)
    return out


TOPK_CHUNK = 4096
"""Scores a top-k program reads at a time (8 warps: 16 a thread)."""


@torch.no_grad()
def topk_rows(scores_TW: torch.Tensor, lens_T: torch.Tensor, k: int) -> torch.Tensor:
    """Positions [T, k] (int64, ascending) of the k largest of each row's first ``lens_T`` scores,
    exact ties at the cut going to the earlier position (:func:`rlcli.ops.mla._topk_earliest`'s
    rule; -0.0 ties +0.0; no NaN); a row of at most k scores gets ``0..k-1`` (those past its
    length are the caller's invalid entries). One program per row, whose work follows the row's
    length, not the width: a decode graph's scores span ``max_model_len`` whatever the contexts."""
    T, W = scores_TW.shape
    assert scores_TW.dtype == torch.float32 and scores_TW.stride(1) == 1 and k <= W, (scores_TW.shape, k)
    out = torch.empty(T, k, dtype=torch.int64, device=scores_TW.device)
    if T:
        _kernels()._topk_rows_kernel[(T,)](scores_TW, lens_T, out, k, scores_TW.stride(0), out.stride(0),
                                           CHUNK=TOPK_CHUNK, num_warps=8)
    return out


_BK, _BK_BWD = 32, 16  # selected tokens per block (backward: smaller, for registers)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _head_block(H: int) -> int:
    return 16 if H <= 16 else 32


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THL, kv_SL, ids_Tk, rank: int, scale: float, counts_T=None):
        T, H, L = q_THL.shape
        K = ids_Tk.shape[1]
        o = torch.empty(T, H, rank, dtype=q_THL.dtype, device=q_THL.device)
        lse = torch.empty(T, H, dtype=torch.float32, device=q_THL.device)
        HB = _head_block(H)
        grid = (T, _cdiv(H, HB))
        _kernels()._sparse_fwd_kernel[grid](q_THL, kv_SL, ids_Tk, ids_Tk if counts_T is None else counts_T, o, lse,
                                 scale, H, K, q_THL.stride(0), q_THL.stride(1),
                                 kv_SL.stride(0), ids_Tk.stride(0), o.stride(0), o.stride(1), HB=HB, R=rank,
                                 RP=_padded(rank), DR=L - rank, DRP=_padded(L - rank), BK=_BK, PREC=_precision(q_THL),
                                 COUNTS=counts_T is not None, num_warps=4)
        ctx.save_for_backward(q_THL, kv_SL, ids_Tk, o, lse)
        ctx.rank, ctx.scale = rank, scale
        return o

    @staticmethod
    def backward(ctx, do_THR):
        q_THL, kv_SL, ids_Tk, o, lse = ctx.saved_tensors
        T, H, L = q_THL.shape
        do = do_THR.contiguous()
        dq = torch.empty_like(q_THL)
        dkv = torch.zeros(kv_SL.shape, dtype=torch.float32, device=kv_SL.device)
        HB = _head_block(H)
        _kernels()._sparse_bwd_kernel[(T, _cdiv(H, HB))](
            q_THL, kv_SL, ids_Tk, o, do, lse, dq, dkv, ctx.scale, H, ids_Tk.shape[1], q_THL.stride(0),
            q_THL.stride(1), kv_SL.stride(0), ids_Tk.stride(0), o.stride(0), o.stride(1), HB=HB, R=ctx.rank,
            RP=_padded(ctx.rank), DR=L - ctx.rank, DRP=_padded(L - ctx.rank), BK=_BK_BWD, PREC=_precision(q_THL),
            num_warps=8)
        return dq, dkv.to(kv_SL.dtype), None, None, None, None


def sparse_attention(q_THL: torch.Tensor, kv_SL: torch.Tensor, idx_Tk: torch.Tensor, valid_Tk: torch.Tensor,
                     value_dim: int, scale: float, counts_T: torch.Tensor | None = None) -> torch.Tensor:
    """Each query over its selected latent tokens: [T, H, value_dim] (as
    :func:`rlcli.ops.mla.sparse_latent_attention`), differentiable in ``q`` and ``kv``. ``counts_T``
    (int32): every entry of query ``t`` past ``counts_T[t]`` is invalid, so its forward reads no further
    (the engine's decodes, :func:`rlcli.ops.mla.paged_select_topk`: valid entries first)."""
    ids = torch.where(valid_Tk, idx_Tk, -1).to(torch.int32).contiguous()
    return _SparseAttention.apply(q_THL.contiguous(), kv_SL.to(q_THL.dtype).contiguous(), ids, value_dim, scale,
                                  counts_T)
