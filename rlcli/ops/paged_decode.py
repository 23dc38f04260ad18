"""Decode attention that reads a block-paged KV cache in place (Triton; the native engine on CUDA).

One query token per sequence. A program owns one sequence, one K/V head and one span of positions:
the ``G`` query heads that share that head are the rows of its tiles (padded to 16, ``tl.dot``'s
least; at most 64 a program, fewer for wide heads, so absorbed MLA's many heads split over several
programs), so each key and value is read from the cache once for the whole group. It walks its
positions in tiles of ``BN``, finds each position's block in the sequence's row of ``block_tables``
and its offset in it, and keeps flash attention's running max, denominators and weighted sum in fp32.

Split along the keys (flash-decoding): with few sequences and heads the programs above would not
fill the GPU (8 sequences x 8 K/V heads is 64 programs on an H100's 132 SMs, each walking 24k
positions alone), so when the caller gives the longest context, each sequence's positions are
cut into at most ``MAX_SPLITS`` spans of at least ``MIN_SPLIT`` positions until there are about two
programs per SM; every span writes its unnormalized sum with its max and denominator, and a second
kernel merges the spans of each (sequence, head).

No key or value is gathered or copied: the bucketed SDPA path it replaces on CUDA
(:meth:`rlcli.ops.attention.PagedAttention._decode`) copied every decoding sequence's whole context
out of the cache in every layer, planned buckets on the host and launched ~10 kernels per bucket;
the varlen flash path (half precision) copied it once per layer. fp32 products run in IEEE fp32
(no TF32), so fp32 engines keep the eager path's precision.

The engine takes it with ``infer.engine.paged_decode``. Under ``TRITON_INTERPRET=1`` it runs on CPU
tensors (tests/ops/test_paged_decode.py), and with ``RLCLI_PAGED_DECODE_ON_CPU=1`` as well the
paged attention backend takes it on the CPU by default (the zoo's decode tests under the interpreter).
"""

import functools
import os

import torch

import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32: fp32 operands in IEEE fp32 (no TF32); under the interpreter,
    which has no bf16 products, upcast; else ``a`` in ``b``'s dtype (the probabilities for ``p @ v``)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    elif UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a.to(b.dtype), b)
    return out


# Arguments that change from step to step are not specialized on (Triton otherwise compiles a
# variant for each value class: ==1, a multiple of 16, or neither; a 16-byte-aligned pointer or
# not): the table row stride (the step's widest table), the span statistics' strides and count
# (the step's number of spans), and the tables' start (a slice of the step's one host-to-device
# copy). So the kernel compiles once whole and once split, the merge once, and
# NativeEngine.warm_up can compile all three before the first request.
@triton.jit(do_not_specialize=["s_ms", "s_mh", "s_ts"], do_not_specialize_on_alignment=["TABLES"])
def _paged_decode_kernel(Q, K, V, O, M_OUT, L_OUT, TABLES, LENS, scale, G, D, DV, BS, MIN_SPAN,
                         s_qs, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_os, s_oh, s_op, s_ms, s_mh, s_ts,
                         BG: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr):
    """Span ``span`` of one sequence's ``n`` positions for one group of query heads. The sequence's
    positions are cut into the grid's ``NSPLIT`` spans of ``max(MIN_SPAN, n / NSPLIT rounded up to
    BN)`` positions each, so a shorter context takes fewer spans and the rest are empty. ``SPLIT``:
    write the unnormalized sum to ``O[seq, h, span]`` and its max and denominator to
    ``M_OUT`` / ``L_OUT[seq, h, span]`` (an empty span writes -inf, 0 and zeros); else the output
    itself (one span holds the whole context)."""
    seq = tl.program_id(0)
    hk = tl.program_id(1) // tl.cdiv(G, BG)
    span = tl.program_id(2)
    n = tl.load(LENS + seq)
    span_len = tl.maximum(tl.cdiv(tl.cdiv(n, tl.num_programs(2)), BN) * BN, MIN_SPAN)
    first = span * span_len
    last = tl.minimum(n, first + span_len)
    g = (tl.program_id(1) % tl.cdiv(G, BG)) * BG + tl.arange(0, BG)
    g_ok = g < G
    h = hk * G + g
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    q = tl.load(Q + seq * s_qs + h[:, None] * s_qh + d[None, :], mask=g_ok[:, None] & (d[None, :] < D), other=0.0)
    m = tl.full([BG], float("-inf"), tl.float32)
    den = tl.zeros([BG], dtype=tl.float32)
    acc = tl.zeros([BG, BDV], dtype=tl.float32)
    for start in range(first, last, BN):
        pos = start + tl.arange(0, BN)
        ok = pos < last
        block = tl.load(TABLES + seq * s_ts + pos // BS, mask=ok, other=0).to(tl.int64)
        off = (pos % BS).to(tl.int64)
        k = tl.load(K + block[:, None] * s_kb + off[:, None] * s_kt + hk * s_kh + d[None, :],
                    mask=ok[:, None] & (d[None, :] < D), other=0.0)
        s = tl.where(ok[None, :], _dot(q, tl.trans(k), IEEE, UPCAST) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: a span's first tile holds a key
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v = tl.load(V + block[:, None] * s_vb + off[:, None] * s_vt + hk * s_vh + dv[None, :],
                    mask=ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p, v, IEEE, UPCAST)
        m = m_new
    o_ok = g_ok[:, None] & (dv[None, :] < DV)
    if SPLIT:
        tl.store(O + seq * s_os + h[:, None] * s_oh + span * s_op + dv[None, :], acc, mask=o_ok)
        tl.store(M_OUT + seq * s_ms + h * s_mh + span, m, mask=g_ok)
        tl.store(L_OUT + seq * s_ms + h * s_mh + span, den, mask=g_ok)
    else:
        tl.store(O + seq * s_os + h[:, None] * s_oh + dv[None, :], (acc / den[:, None]).to(O.dtype.element_ty),
                 mask=o_ok)


@triton.jit(do_not_specialize=["NSPLIT", "s_ms", "s_mh"])
def _merge_spans_kernel(PART, M_IN, L_IN, O, NSPLIT, DV, s_ps, s_ph, s_pp, s_ms, s_mh, s_os, s_oh,
                        BSPLIT: tl.constexpr, BDV: tl.constexpr):
    """One (sequence, head): the spans' sums rescaled to their common max, over their denominators."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    k = tl.arange(0, BSPLIT)
    k_ok = k < NSPLIT
    dv = tl.arange(0, BDV)
    m = tl.load(M_IN + seq * s_ms + h * s_mh + k, mask=k_ok, other=float("-inf"))
    den = tl.load(L_IN + seq * s_ms + h * s_mh + k, mask=k_ok, other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))  # the first span always holds a key: its max is finite
    part = tl.load(PART + seq * s_ps + h * s_ph + k[:, None] * s_pp + dv[None, :],
                   mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(den * w, axis=0)
    tl.store(O + seq * s_os + h * s_oh + dv, out.to(O.dtype.element_ty), mask=dv < DV)


MIN_SPLIT = 512
"""Positions a span holds at least: fewer and the merge costs more than the parallelism saves."""

MAX_SPLITS = 32
"""Spans per sequence at most: the merge kernel's one tile size, so it compiles once (a tile sized to
each step's count compiled again for each new power of two, ~0.1-0.3 s apiece inside early steps)."""

WARM_UP_CONTEXTS = (1, 2 * MIN_SPLIT)
"""Context lengths whose decodes (one sequence each) run every compiled variant between them: one
span (the kernel whole), two (the kernel split, then the merge). :meth:`NativeEngine.warm_up`."""


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def num_splits_for(programs: int, max_context_len: int, device: torch.device) -> int:
    """Spans per sequence: enough for about two programs per SM, none shorter than ``MIN_SPLIT``."""
    want = -(-2 * _num_sms(device) // max(programs, 1))
    return max(1, min(want, max_context_len // MIN_SPLIT, MAX_SPLITS))


def _tiles(G: int, D: int, Dv: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(query heads per program, key and value tile widths, positions per tile)."""
    BD = max(16, triton.next_power_of_2(D))
    BDV = max(16, triton.next_power_of_2(Dv))
    BN = 64 if dtype.itemsize < 4 else 32
    while BN > 16 and BN * max(BD, BDV) * dtype.itemsize > 32 * 1024:
        BN //= 2
    BG = max(16, min(triton.next_power_of_2(G), 64))  # query heads per program (absorbed MLA has 16-128)
    while BG > 16 and BG * max(BD, BDV) > 16 * 1024:
        BG //= 2
    return BG, BD, BDV, BN


SHARED_MEMORY_BYTES = 192 * 1024
"""What a program's tiles may take (the query's, and two stages of keys and values): an H100's or
H200's SM has 227 KB. DeepSeek-V3's latent (576 key, 512 value features) fits in bf16 (131 KB);
in fp32 it would take 262 KB and does not compile."""


@functools.lru_cache(maxsize=None)  # asked by every layer of every eager step
def fits(G: int, D: int, Dv: int, dtype: torch.dtype) -> bool:
    """Whether the kernel's tiles for these head widths fit in an SM's shared memory."""
    BG, BD, BDV, BN = _tiles(G, D, Dv, dtype)
    return (BG * BD + 2 * BN * (BD + BDV)) * dtype.itemsize <= SHARED_MEMORY_BYTES


def _trim(num_splits: int, max_context_len: int, BN: int, min_span: int) -> int:
    """No span wholly past every context: as many as the longest one fills, cut as the kernel cuts it."""
    span = max(triton.cdiv(triton.cdiv(max_context_len, num_splits), BN) * BN, min_span)
    return triton.cdiv(max_context_len, span)


def splits_for(S: int, Hq: int, Hkv: int, D: int, Dv: int, dtype: torch.dtype, max_context_len: int,
               device: torch.device, min_span: int = MIN_SPLIT) -> int:
    """The spans per sequence :func:`paged_decode` cuts ``S`` decodes into when the longest context is
    ``max_context_len``: :func:`num_splits_for` its programs, trimmed to what that context fills."""
    BG, _, _, BN = _tiles(Hq // Hkv, D, Dv, dtype)
    num_splits = num_splits_for(S * Hkv * triton.cdiv(Hq // Hkv, BG), max_context_len, device)
    return _trim(num_splits, max_context_len, BN, min_span) if num_splits > 1 else 1


def paged_decode(q_SHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, max_context_len: int | None = None,
                 num_splits: int | None = None, min_span: int = MIN_SPLIT) -> torch.Tensor:
    """Attention of one query per sequence over its cached keys, ``[S, Hq, Dv]``.

    ``k_cache [num_blocks, block_size, Hkv, D]`` and ``v_cache [num_blocks, block_size, Hkv, Dv]``
    (``v_cache`` may be a strided view of ``k_cache``, as MLA's latent); sequence ``i``'s keys are
    its first ``context_lens[i]`` positions (>= 1), position ``p`` in block ``block_tables[i, p //
    block_size]`` at offset ``p % block_size``. Query head ``h`` reads K/V head ``h // (Hq / Hkv)``.
    ``max_context_len`` (the largest of ``context_lens``, known on the host) lets the keys be split
    over several programs per sequence (:func:`num_splits_for`); ``num_splits`` sets that count
    instead. Without either each sequence is one span. Split, each sequence cuts its own context into
    that many spans of at least ``min_span`` positions (so a short one fills fewer, and the rest are
    empty); given ``max_context_len``, the count is trimmed to the spans the longest context fills.
    A graph replayed at other contexts (:mod:`rlcli.infer.cuda_graphs`) passes ``num_splits`` alone."""
    S, Hq, D = q_SHD.shape
    bs, Hkv, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    out = torch.empty(S, Hq, Dv, device=q_SHD.device, dtype=q_SHD.dtype)
    if S == 0:
        return out
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode needs the head dim innermost (stride 1) in both caches")
    if q_SHD.stride(-1) != 1:
        q_SHD = q_SHD.contiguous()
    tables = block_tables if block_tables.dtype in (torch.int32, torch.int64) else block_tables.long()
    lens = context_lens.to(device=q_SHD.device, dtype=torch.int32)
    G = Hq // Hkv
    BG, BD, BDV, BN = _tiles(G, D, Dv, q_SHD.dtype)
    if num_splits is None:
        num_splits = (splits_for(S, Hq, Hkv, D, Dv, q_SHD.dtype, max_context_len, q_SHD.device, min_span)
                      if max_context_len else 1)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"paged_decode: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if num_splits > 1 and max_context_len is not None:
        num_splits = _trim(num_splits, max_context_len, BN, min_span)
    split = num_splits > 1
    if split:
        part = torch.empty(S, Hq, num_splits, Dv, device=q_SHD.device, dtype=torch.float32)
        m_part = torch.empty(S, Hq, num_splits, device=q_SHD.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        dst, s_os, s_oh, s_op = part, part.stride(0), part.stride(1), part.stride(2)
    else:
        part = m_part = l_part = out  # unused pointers
        dst, s_os, s_oh, s_op = out, out.stride(0), out.stride(1), 0
    _paged_decode_kernel[(S, Hkv * triton.cdiv(G, BG), num_splits)](
        q_SHD, k_cache, v_cache, dst, m_part, l_part, tables, lens, float(scale), G, D, Dv, bs, max(min_span, 1),
        q_SHD.stride(0), q_SHD.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), s_os, s_oh, s_op,
        m_part.stride(0) if split else 0, m_part.stride(1) if split else 0, tables.stride(0),
        BG=BG, BD=BD, BDV=BDV, BN=BN, IEEE=q_SHD.dtype == torch.float32,
        UPCAST=_INTERPRET, SPLIT=split, num_warps=4, num_stages=2)
    if split:
        _merge_spans_kernel[(S, Hq)](
            part, m_part, l_part, out, num_splits, Dv, part.stride(0), part.stride(1), part.stride(2),
            m_part.stride(0), m_part.stride(1), out.stride(0), out.stride(1),
            BSPLIT=MAX_SPLITS, BDV=BDV, num_warps=4)
    return out
