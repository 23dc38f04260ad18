"""rlcli.ops.fp8.grouped_triton (the FP8 block-scaled grouped GEMM that reads the group offsets on
the device) against the emulated reference (dequantize, fp32 matmul): groups empty and ragged, rows
past the last group, K and N off the 128 grid, each tile height; the tile map without a host sync;
and the torch backend with it (training and inference) against the loop over the groups.

They run on CUDA. Without CUDA, where triton is installed and its interpreter works,
``test_under_the_interpreter`` runs this file in a child process on CPU tensors.
"""

import pytest
import torch

import interpreter
from rlcli.ops.fp8 import quant
from rlcli.ops.fp8.backends import EmulatedBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu" if interpreter.ACTIVE else None


def _kernel():
    if DEVICE is None:
        pytest.skip("needs CUDA; without it test_under_the_interpreter runs these")
    from rlcli.ops.fp8 import grouped_triton

    if not grouped_triton.available():
        pytest.skip("triton does not import")
    return grouped_triton


@pytest.mark.skipif(DEVICE is not None, reason="the kernel runs here directly")
def test_under_the_interpreter():
    interpreter.run_child_or_skip(__file__)


def _operands(counts: list[int], extra: int, N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    M = sum(counts) + extra
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g))
    w = torch.randn(len(counts), N, K, generator=g) * 0.05
    a, sa = quant.quantize_1x128(x)
    b, sb = quant.quantize_128x128(w)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return [t.to(DEVICE) for t in (a, sa, b, sb, offs)]


# (rows per group, rows past the last group, N, K): decode-like groups of 0-3 rows over many experts
# (16-row tiles), mid and large groups (32- and 64-row tiles), N and K off the 128 grid, a group
# count one short of a power of two (the tile map's padding groups), and more groups than rows.
CASES = [([1, 0, 3, 2, 0, 0, 1, 2], 0, 256, 256),
         ([2, 0, 1, 0, 0, 3, 1], 1, 128, 256),
         ([0] * 10 + [1, 0, 2, 0, 0, 1, 0, 0, 0, 1], 0, 128, 256),
         ([0, 5, 0, 0], 3, 96, 200),
         ([40, 17, 0, 33], 0, 130, 384),
         ([70, 129, 1], 2, 128, 128),
         ([0, 0, 0], 4, 128, 128)]


@pytest.mark.parametrize("counts,extra,N,K", CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_dequantized_reference(counts, extra, N, K, out_dtype):
    gt = _kernel()
    if out_dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's bf16 is numpy's emulation")
    a, sa, b, sb, offs = _operands(counts, extra, N, K)
    sa_col = sa.t().contiguous().t()  # the quantizers' column-major layout, as the engine passes it
    got = gt.grouped_gemm(a, sa_col, b, sb, offs, out_dtype)
    want = EmulatedBackend().grouped_gemm(a, sa, b, sb, offs, torch.float32)
    assert got.dtype == out_dtype and got.shape == want.shape
    # On Hopper the FP8 MMA (wgmma, 64-row tiles) sums a 128-wide block in reduced precision, as in
    # DeepGEMM (the block's result is then added in fp32): ~1e-4 of the output's largest value.
    tol = 1e-2 if out_dtype == torch.bfloat16 else 1e-3 if DEVICE == "cuda" else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    if extra:
        assert (got[sum(counts):] == 0).all()  # rows of no group


def test_the_grid_bound_holds_every_groups_tiles():
    gt = _kernel()
    counts = [3, 0, 17, 16, 0, 1]  # 1 + 2 + 1 + 1 tiles of 16, then 3 rows past the last group: one more
    assert gt.tiles(sum(counts) + 3, len(counts), 16) == 3 + 6 + 1 >= 6
    assert gt.tiles(64, 256, 16) == 4 + 64 + 1  # at most 64 of 256 groups have rows; shapes alone: a graph holds it


@pytest.mark.parametrize("tile", [(128, 8, 3), (64, 4, 2), (16, 4, 3)])
def test_every_tile_shape_computes_the_same(tile):
    """Tiles of 128 rows (eight warps), 64 and 16, forced on the same operands, including rows past
    the last group (zeroed by their own tiles; the output is not memset)."""
    gt = _kernel()
    a, sa, b, sb, offs = _operands([130, 0, 7, 260], 5, 384, 256, seed=3)
    want = EmulatedBackend().grouped_gemm(a, sa, b, sb, offs, torch.float32)
    got = gt.grouped_gemm(a, sa, b, sb, offs, torch.float32, tile=tile)
    tol = 1e-3 if DEVICE == "cuda" else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    assert (got[397:] == 0).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="the torch backend needs SM90")
@torch.no_grad()
def test_torch_backend_groups_on_the_device():
    """make_backend("torch") on Hopper, for training and inference: grouped GEMMs through the kernel,
    no host sync (so the decode graphs hold FP8 experts, and an MoE training step does not wait on
    the host per layer), equal to the loop of scaled_mm over the groups."""
    from rlcli.ops.fp8.backends import make_backend

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("scaled_mm's block scales need SM90")
    infer, train = make_backend("torch", DEVICE, inference=True), make_backend("torch", DEVICE)
    assert infer.grouped_on_device and train.grouped_on_device
    loop = make_backend("torch", DEVICE)
    loop.grouped_on_device = False
    for counts, N, K in (([2, 0, 5, 1], 256, 512), ([700, 0, 300, 1100], 384, 1024)):
        a, sa, b, sb, offs = _operands(counts, 0, N, K)
        sa = sa.t().contiguous().t()
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        infer.grouped_gemm(a, sa, b, sb, offs, torch.bfloat16)  # compiles outside the capture
        with torch.cuda.graph(graph, stream=stream):
            out = infer.grouped_gemm(a, sa, b, sb, offs, torch.bfloat16)
        graph.replay()
        want = loop.grouped_gemm(a, sa, b, sb, offs, torch.bfloat16)
        torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
        torch.testing.assert_close(train.grouped_gemm(a, sa, b, sb, offs, torch.bfloat16).float(), want.float(),
                                   rtol=1e-2, atol=1e-2 * want.abs().max().item())


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
