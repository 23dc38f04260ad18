"""An FP8 block-scaled grouped GEMM in Triton that reads the group offsets on the device.

``grouped_gemm(a, sa, b, sb, offs)`` computes, for every group ``g``, rows ``offs[g-1]:offs[g]``
of ``a`` (1x128 tiles along K) times ``b[g]^T`` (128x128 blocks), with fp32 accumulation:
the operands and result of :meth:`GemmBackend.grouped_gemm`. ``scaled_mm`` has no grouped form
for block scales, so the torch backend otherwise loops over the groups, which reads the offsets
on the host (one sync per MoE layer) and runs one GEMM per expert, each padded to 128 rows. In
the native engine (inference, :func:`rlcli.ops.fp8.backends.make_backend` with ``inference``)
that loop kept FP8 MoE models out of the decode graphs and launched ``experts x 3`` GEMMs a layer.

Each program computes a ``BM x 128`` tile of one group's rows: the rows are cut into tiles per
group (tiles never straddle two groups), up to ``ceil(M / BM) + min(G, M) + 1`` tiles (a bound
fixed by the shapes alone, so a CUDA graph holds it), and tiles past the groups' own return at once. Each
program finds its tile from the offsets itself (the groups' tile counts, their running sum, and
the group whose tiles hold its own: a few vector operations over the ``G`` offsets), so the
launch is one kernel. Worked out by torch operations beforehand, the same map took some 18 small
kernels: on an H100, in a CUDA graph, a one-group grouped GEMM of 64 rows then took 34.6 µs where
the decode linear kernel took 5.9 on the same rows (docs/benchmarks.md, thirty-fourth session).

Along K the program takes one 128-wide block at a time: ``dot(a_blk, b_blk^T)`` in fp32, times
the row's scale times the weight block's scale, summed over the blocks, the order DeepGEMM's
kernels accumulate in. Rows that belong to no group are zero, written by tiles of their own (the
output is not memset first).

The tile follows the rows per group (:func:`block_m`): 16 to 64 rows by 128 columns. The programs
are numbered column block first, so the programs running at once share a few row tiles (read from
L2 once per column block) and one group's weight. The same kernel serves training's grouped GEMMs
(forward and input gradient) where DeepGEMM does not run; on an H100 it ran at 0.40-0.81x bf16
``grouped_mm``'s TFLOP/s (six expert shapes; its tile map then still worked out by torch), against
0.04-0.34x for the loop of ``scaled_mm`` it replaced (docs/benchmarks.md).

``model.batch_invariant`` runs its own grouped kernel instead
(:func:`rlcli.ops.invariant_kernels.fp8_grouped_mm`): fixed 128-row tiles over the batch's rows, each
walking the groups inside it, so that a row's bits do not depend on the batch; here tiles follow the
groups, so a decode batch spread over many experts computes 16-row tiles, not 128-row ones.
"""

import torch

from rlcli.ops.fp8.quant import BLOCK

try:
    import triton
    import triton.language as tl
except (ImportError, OSError):  # CPU CI: no triton
    triton = tl = None


def available() -> bool:
    return triton is not None


def block_m(rows: int, groups: int) -> int:
    """Rows per tile: 16 (``tl.dot``'s least) where the groups average at most 16 rows (decode
    batches over many experts), up to 64 for larger groups. On an H100, 128-row tiles with eight
    warps were no faster on training's groups (docs/benchmarks.md, thirty-fourth session)."""
    per_group = rows / max(groups, 1)
    return 16 if per_group <= 16 else 32 if per_group <= 32 else 64


if triton is not None:

    @triton.jit
    def _grouped_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, offs_ptr, M, N, K, G, stride_am, stride_sam,
                        stride_sak, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_om,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GP: tl.constexpr):
        pid = tl.program_id(0)
        NB = tl.cdiv(N, BN)
        tile = pid // NB
        nb = pid % NB
        # The tile map, from the offsets (module docstring): group gi holds rows starts[gi]:ends[gi]; group G
        # the rows past the last one (to M); the padding groups past it are empty.
        gi = tl.arange(0, GP)
        ends = tl.where(gi < G, tl.load(offs_ptr + gi, mask=gi < G, other=0), M)
        starts = tl.where(gi == 0, 0, tl.where(gi <= G, tl.load(offs_ptr + gi - 1, mask=(gi >= 1) & (gi <= G),
                                                                other=0), M))
        tiles = (ends - starts + BM - 1) // BM
        tile_end = tl.cumsum(tiles, 0)
        g = tl.sum((tile_end <= tile).to(tl.int32), 0)  # the group whose tiles hold this one
        if g > G:  # a tile past every group's own
            return
        mine = gi == g
        row0 = tl.sum(tl.where(mine, starts + (tile - (tile_end - tiles)) * BM, 0), 0).to(tl.int64)
        end = tl.sum(tl.where(mine, ends, 0), 0)
        rows = row0 + tl.arange(0, BM)
        rmask = rows < end
        cols = nb * BN + tl.arange(0, BN)
        cmask = cols < N
        if g == G:  # rows past the last group: zeros
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
                     tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
            return
        ks = tl.arange(0, BK)
        a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :]
        b_ptrs = b_ptr + g * stride_bg + cols[:, None] * stride_bn + ks[None, :]
        sa_ptrs = sa_ptr + rows * stride_sam
        sb_ptrs = sb_ptr + g * stride_sbg + nb * stride_sbn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            kmask = kb * BK + ks < K
            a = tl.load(a_ptrs + kb * BK, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs + kb * BK, mask=cmask[:, None] & kmask[None, :], other=0.0)
            # the row's scale times the block's first, as DeepGEMM promotes: one FMA per element
            scale = tl.load(sa_ptrs + kb * stride_sak, mask=rmask, other=0.0) * tl.load(sb_ptrs + kb)
            acc += tl.dot(a, tl.trans(b)) * scale[:, None]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


def tiles(rows: int, groups: int, bm: int) -> int:
    """How many tiles the grid holds: enough for every group's own (a group of ``c`` rows takes
    ``ceil(c / bm)`` tiles, at most ``c / bm + 1``, and only groups with rows take any, at most
    ``min(groups, rows)`` of them) and the rows past the last group: ``ceil(rows / bm) +
    min(groups, rows) + 1``, a bound fixed by the shapes alone. A decode batch of 64 rows over 256
    experts launches 69 tiles a column block, not 261."""
    return -(-rows // bm) + min(groups, rows) + 1


def grouped_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor,
                 out_dtype: torch.dtype, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``a [M, K]`` FP8 rows sorted by group with 1x128 scales ``sa [M, K/128]`` (any strides),
    ``b [G, N, K]`` FP8 with 128x128 scales ``sb [G, N/128, K/128]``, ``offs [G]`` cumulative row
    ends -> ``[M, N]`` in ``out_dtype`` (module docstring). ``tile``: ``(BM, num_warps, num_stages)``
    in place of ``(block_m(M, G), 4, 3)``."""
    M, K = a.shape
    G, N, _ = b.shape
    if M == 0 or G == 0:
        return torch.zeros(M, N, dtype=out_dtype, device=a.device)
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    a = a if a.stride(1) == 1 else a.contiguous()
    b, sb, offs = b.contiguous(), sb.contiguous(), offs.contiguous()
    bm, warps, stages = tile or (block_m(M, G), 4, 3)
    grid = (tiles(M, G, bm) * triton.cdiv(N, BLOCK),)
    _grouped_kernel[grid](a, sa, b, sb, out, offs, M, N, K, G, a.stride(0), sa.stride(0), sa.stride(1),
                          b.stride(0), b.stride(1), sb.stride(0), sb.stride(1), out.stride(0),
                          BM=bm, BN=BLOCK, BK=BLOCK, GP=triton.next_power_of_2(G + 1), num_warps=warps,
                          num_stages=stages)
    return out
