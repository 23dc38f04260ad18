"""rlcli.ops.fp8.linear_triton (an FP8 engine's decode linears: the 1x128 quantization fused into the
block-scaled GEMM): its quantization bit for bit against the reference quantizer, its product
against the emulated reference (dequantize, fp32 matmul) over ragged shapes, tile heights and
widths; the backends made for inference routing decode rows to it, inside a CUDA graph; and the
batch-invariant wrapper never doing so.

The kernel tests run on CUDA. Without CUDA, where triton is installed and its interpreter works,
``test_under_the_interpreter`` runs this file in a child process on CPU tensors.
"""

import pytest
import torch

import interpreter
from rlcli.ops.fp8 import quant
from rlcli.ops.fp8.backends import EmulatedBackend, gemm_x

DEVICE = "cuda" if torch.cuda.is_available() else "cpu" if interpreter.ACTIVE else None


def _kernel():
    if DEVICE is None:
        pytest.skip("needs CUDA; without it test_under_the_interpreter runs these")
    from rlcli.ops.fp8 import linear_triton

    if not linear_triton.available():
        pytest.skip("triton does not import")
    return linear_triton


@pytest.mark.skipif(DEVICE is not None, reason="the kernel runs here directly")
def test_under_the_interpreter():
    interpreter.run_child_or_skip(__file__)


def _identity(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``I [k, k]`` in FP8 (ones on the diagonal) with unit block scales: the GEMM then returns the
    dequantized activation, one nonzero product per output, so its bits are the quantizer's."""
    nb = quant.ceil_div(k, quant.BLOCK)
    return torch.eye(k).to(quant.FP8_DTYPE).to(DEVICE), torch.ones(nb, nb, device=DEVICE)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_the_fused_quantization_is_the_reference_bit_for_bit(ue8m0):
    lt = _kernel()
    g = torch.Generator().manual_seed(0)
    cases = quant.rounding_cases()  # every e4m3 value, midpoint and neighbour at scale 1
    rand = torch.randn(24, 384, generator=g) * torch.exp(3 * torch.randn(24, 1, generator=g))
    rand[3] = 0.0  # an all-zero row: the amax floor
    for x in (cases, cases.reshape(1, -1), rand[:, :200], rand):
        w, ws = _identity(x.shape[1])
        want = quant.dequantize_1x128(*quant.quantize_1x128(x, ue8m0))
        for splits in (1, 2):  # split K: the other blocks add exact zeros
            got = lt.linear(x.to(DEVICE), w, ws, ue8m0, torch.float32, splits=splits).cpu()
            assert torch.equal(got, want), (got - want).abs().max()


# (rows, N, K): one row (a single decode), each tile height, N and K off the 128 grid, and rows over
# several 64-row tiles
CASES = [(1, 256, 256), (5, 96, 200), (16, 384, 128), (17, 130, 384), (40, 256, 640), (64, 512, 256),
         (130, 256, 384)]


@pytest.mark.parametrize("M,N,K", CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_the_dequantized_reference(M, N, K, out_dtype):
    lt = _kernel()
    if out_dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's bf16 is numpy's emulation")
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g))
    w, ws = quant.quantize_128x128(torch.randn(N, K, generator=g) * 0.05)
    want = EmulatedBackend().gemm(*quant.quantize_1x128(x), w, ws, torch.float32)
    # Hopper's FP8 MMA sums a 128-wide block in reduced precision (test_fp8_grouped_triton.py)
    tol = 1e-2 if out_dtype == torch.bfloat16 else 1e-3 if DEVICE == "cuda" else 1e-5
    for bn, splits in ((None, 1), (16, 1), (64, 1), (128, 1), (None, 2), (32, 3), (None, None)):
        got = lt.linear(x.to(DEVICE), w.to(DEVICE), ws.to(DEVICE), False, out_dtype, bn=bn, splits=splits)
        assert got.dtype == out_dtype and got.shape == (M, N)
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol * want.abs().max().item())
    xq, xs = quant.quantize_1x128(x)
    xs_cols = xs.t().contiguous().t()  # column-major, as the quantization kernel lays its scales out
    for splits in (1, 2):  # already quantized: read as it is
        got = lt.linear(xq.to(DEVICE), w.to(DEVICE), ws.to(DEVICE), False, out_dtype, splits=splits,
                        xs=xs_cols.to(DEVICE))
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_split_k_fills_the_gpu_and_keeps_two_blocks_a_split():
    from rlcli.ops.fp8.linear_triton import split_k

    assert split_k(24576, 1536, 64, 132) == 1  # 384 column tiles fill an H100 alone
    assert split_k(1536, 7168, 16, 132) == 6  # 96 tiles: 6 splits of 10 blocks
    assert split_k(576, 7168, 16, 132) == 15  # 36 tiles
    assert split_k(1024, 1024, 16, 132) == 4  # 8 blocks: at least 2 a split
    assert split_k(1024, 256, 16, 132) == 1  # 2 blocks: no split
    assert split_k(7168, 16384, 64, 132) == 5


def test_strided_rows_and_scales():
    """A row slice of a wider activation and a transposed-then-copied scale: strides are honoured."""
    lt = _kernel()
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(8, 512, generator=g)
    x = wide[:, :256]  # row stride 512
    w, ws = quant.quantize_128x128(torch.randn(128, 256, generator=g))
    want = EmulatedBackend().gemm(*quant.quantize_1x128(x), w, ws, torch.float32)
    got = lt.linear(wide.to(DEVICE)[:, :256], w.to(DEVICE), ws.t().contiguous().t().to(DEVICE), False, torch.float32)
    tol = 1e-3 if DEVICE == "cuda" else 1e-5
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol * want.abs().max().item())


class _Counting(EmulatedBackend):
    fused_rows = True
    calls = 0

    def gemm(self, a, sa, b, sb, out_dtype):
        self.calls += 1
        return super().gemm(a, sa, b, sb, out_dtype)


def test_cpu_rows_quantize_then_gemm():
    """gemm_x sends only CUDA rows to the kernel; elsewhere the backend's quantize-then-gemm."""
    from rlcli.ops.fp8 import linear_triton

    assert linear_triton.serves(16, 3072, 1024) and linear_triton.serves(32, 16384, 7168)
    assert linear_triton.serves(64, 7168, 4096) and not linear_triton.serves(64, 16384, 7168)
    assert not linear_triton.serves(65, 1024, 1024)
    be = _Counting()
    x = torch.randn(2, 3, 256)
    w, ws = quant.quantize_128x128(torch.randn(128, 256))
    y = gemm_x(be, x, False, w, ws, torch.float32)
    assert be.calls == 1 and y.shape == (2, 3, 128)
    torch.testing.assert_close(y, EmulatedBackend().gemm(*quant.quantize_1x128(x.view(6, 256)), w, ws,
                                                         torch.float32).view(2, 3, 128))


class _Aligned(_Counting):
    """A backend whose GEMM wants whole 128-row tiles, as scaled_mm's (``row_align``); it keeps the
    operands it was given."""

    fused_rows = False
    row_align = 128

    def __init__(self):
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def gemm(self, a, sa, b, sb, out_dtype):
        assert a.shape[0] % 128 == 0 and sa.shape[0] == a.shape[0], (a.shape, sa.shape)
        self.seen.append((a.clone(), sa.clone()))
        return super().gemm(a, sa, b, sb, out_dtype)


def test_rows_are_quantized_into_whole_tiles_where_the_gemm_wants_them():
    """gemm_x of 3 or 192 rows through a backend with row_align 128: the quantization appends the
    zero rows (no pad copies in gemm): the GEMM gets the unpadded quantization bit for bit, then zero FP8
    rows; the output is the rows asked for. 256 rows take no padding. (The
    reference quantizes as gemm_x does, by the runtime's quantizer: the Triton kernel where it
    imports, which may round a scale one ulp apart from quant.quantize_1x128. The products are
    compared to fp32 summation order: a 128-row and a 3-row matmul may sum K in different orders.)"""
    from rlcli.ops.fp8 import runtime

    g = torch.Generator().manual_seed(0)
    w, ws = quant.quantize_128x128(torch.randn(128, 256, generator=g))
    for rows, padded in ((3, 128), (192, 256), (256, 256)):
        be = _Aligned()
        x = torch.randn(rows, 256, generator=g)
        y = gemm_x(be, x, False, w, ws, torch.float32)
        (a, sa), = be.seen
        assert y.shape == (rows, 128) and a.shape[0] == padded
        (xq, xs), _ = runtime.quantize_input(x.clone(), False, cols=False)  # unpadded, not the cached padded one
        assert xq.shape[0] == rows
        assert torch.equal(a[:rows].view(torch.uint8), xq.view(torch.uint8)) and torch.equal(sa[:rows], xs)
        assert not a[rows:].view(torch.uint8).any()
        want = EmulatedBackend().gemm(xq, xs, w, ws, torch.float32)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_invariant_wrapper_keeps_its_own_gemm():
    """model.batch_invariant wraps an inference backend: decode rows must not reach the fused kernel,
    whose tiles follow the batch (KernelGemm.fused_rows hides the inner backend's)."""
    from rlcli.ops.batch_invariant import KernelGemm

    inner = _Counting()
    wrapped = KernelGemm(inner)
    assert not wrapped.fused_rows and inner.fused_rows
    w, ws = quant.quantize_128x128(torch.randn(128, 256))
    wrapped.gemm_x(torch.randn(4, 256), False, w, ws, torch.float32)
    assert inner.calls == 1  # the CPU path; on CUDA its own invariant fp8_mm


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernel backends need SM90")
@torch.no_grad()
def test_inference_backend_sends_decode_rows_to_the_kernel_in_a_graph(monkeypatch):
    """make_backend(inference=True): a decode batch's linear (<= 32 rows; 64 for weights under 64M
    elements) runs the kernel on its quantized rows (capturable in a graph), 65 rows the
    scaled_mm path; both agree with the training backend."""
    from rlcli.ops.fp8 import linear_triton
    from rlcli.ops.fp8.backends import make_backend

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("scaled_mm's block scales need SM90")
    infer, train = make_backend("torch", DEVICE, inference=True), make_backend("torch", DEVICE)
    assert infer.fused_rows and not train.fused_rows
    calls = []
    real = linear_triton.linear
    monkeypatch.setattr(linear_triton, "linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    small = quant.quantize_128x128(torch.randn(512, 4096, device=DEVICE) * 0.05)
    large = quant.quantize_128x128(torch.randn(4096, 4096, device=DEVICE) * 0.05)
    for rows, (w, ws) in ((3, small), (16, large), (32, small), (64, large), (65, small)):
        x = torch.randn(rows, 4096, device=DEVICE, dtype=torch.bfloat16)
        infer.gemm_x(x, False, w, ws, torch.bfloat16)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = infer.gemm_x(x, False, w, ws, torch.bfloat16)
        graph.replay()
        want = train.gemm_x(x, False, w, ws, torch.bfloat16)
        torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
    assert calls == [3, 3, 16, 16, 32, 32, 64, 64]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
