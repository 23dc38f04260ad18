"""The Triton quantization kernels equal the torch reference bit for bit, run on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``, in a child process: the interpreter is chosen when the
kernels are defined). Skipped where triton does not import (CI); the torch path is tested in test_fp8.py.

Checked: 1x128 rows, the transposed 1x128 (x^T along tokens) and both in one pass; rows stored
to mapped rows of a padded buffer (the grouped MoE layout); zero rows appended to 128 in the
same pass (scaled_mm's tiles); 128x128 blocks
and their transpose, 2-D and stacked experts; fp32 and bf16 inputs, ragged shapes, UE8M0; every
e4m3 value, every rounding midpoint and its neighbours, subnormals and signed zeros; and the FP8
linear and grouped GEMM run through the Triton path give the same outputs and gradients as
through the torch path.
"""

import importlib.util
import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_bit_exact_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all equal" in proc.stdout


def _main() -> None:
    import torch

    from rlcli.ops.fp8 import kernels, quant, runtime
    from rlcli.ops.fp8.backends import EmulatedBackend
    from rlcli.ops.fp8.linear import fp8_grouped_mm, fp8_linear

    def same(a, b, what):
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert a.shape == b.shape and torch.equal(a, b), what

    g = torch.Generator().manual_seed(0)
    x_special = quant.rounding_cases()  # every e4m3 value and midpoint; scale 1: y == x
    cases = [x_special]
    for shape in [(200, 300), (128, 256), (5, 130), (256, 128)]:
        x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 3)
        x[:, 3] *= 50
        cases += [x, x.bfloat16()]
    for x in cases:
        for ue8m0 in (False, True):
            tag = f"{tuple(x.shape)} {x.dtype} ue8m0={ue8m0}"
            r, c = quant.quantize_1x128(x, ue8m0), quant.quantize_1x128(x.t(), ue8m0)
            (q, s), (qt, st) = kernels.quantize_act(x, ue8m0, rows=True, cols=True)
            assert s.stride(0) == 1 and st.stride(0) == 1  # column-major scales
            for a, b, what in [(q, r[0], "q"), (s, r[1], "s"), (qt, c[0], "qt"), (st, c[1], "st")]:
                same(a, b, f"{what} {tag}")
            same(kernels.quantize_act(x, ue8m0)[0], r[0], f"rows only {tag}")
            same(kernels.quantize_act(x, ue8m0, rows=False, cols=True)[0], c[0], f"cols only {tag}")
            (wq, ws), (wqt, wst) = kernels.quantize_weight(x, ue8m0, transposed=True)
            rq, rs = quant.quantize_128x128(x, ue8m0)
            for a, b, what in [(wq, rq, "wq"), (ws, rs, "ws"), (wqt, rq.t().contiguous(), "wqt"), (wst, rs.t(), "wst")]:
                same(a, b, f"{what} {tag}")
    # rows written to mapped rows of a padded buffer (DeepGEMM's grouped layout): the torch path's
    # quantize-then-scatter and the kernel's mapped stores agree on every mapped row
    x = torch.randn(300, 200, generator=g).bfloat16()
    row_map = torch.randperm(520, generator=g)[:300]
    for ue8m0 in (False, True):
        r = quant.quantize_1x128(x, ue8m0)
        for impl in ("torch", "triton"):
            runtime.IMPL["name"] = impl
            q, s = runtime.quantize_rows_to(x, ue8m0, row_map, 520)
            assert q.shape == (520, 200) and s.shape == (520, 2) and s.stride() == (1, 520), impl
            same(q[row_map], r[0], f"mapped q {impl}"), same(s[row_map], r[1], f"mapped s {impl}")
    # zero rows appended in the quantizing pass (scaled_mm's 128-row tiles): the reference of x padded
    # with zero rows, both paths (the kernel's scales column-major over the padded rows)
    for ue8m0 in (False, True):
        r = quant.quantize_1x128(torch.nn.functional.pad(x, (0, 0, 0, 84)), ue8m0)
        for impl in ("torch", "triton"):
            runtime.IMPL["name"] = impl
            q, s = runtime.quantize_act(x, ue8m0, rows_to=384)
            assert q.shape == (384, 200) and (impl == "torch" or s.stride() == (1, 384)), impl
            same(q, r[0], f"padded q {impl}"), same(s, r[1], f"padded s {impl}")
    runtime.IMPL["name"] = "auto"
    w = torch.randn(3, 200, 300, generator=g).bfloat16()
    (q, s), (qt, st) = kernels.quantize_weight(w, False, transposed=True)
    rq, rs = quant.quantize_128x128(w)
    same(q, rq, "experts q"), same(s, rs, "experts s")
    same(qt, rq.transpose(1, 2).contiguous(), "experts qt"), same(st, rs.transpose(1, 2), "experts st")

    be = EmulatedBackend()
    x, wl, dy = torch.randn(2, 150, 256, generator=g), torch.randn(130, 256, generator=g) * 0.05, None
    dy = torch.randn(2, 150, 130, generator=g)
    offs = torch.tensor([50, 50, 180, 300], dtype=torch.int32)
    xg, wg, dyg = torch.randn(300, 200, generator=g), torch.randn(4, 130, 200, generator=g) * 0.05, None
    dyg = torch.randn(300, 130, generator=g)
    results = {}
    for impl in ("torch", "triton"):
        runtime.IMPL["name"] = impl
        out = []
        for fn, a, b, d in [(lambda a, b: fp8_linear(a, b, None, be), x, wl, dy),
                            (lambda a, b: fp8_grouped_mm(a, b, offs, be), xg, wg, dyg)]:
            a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
            y = fn(a, b)
            y.backward(d)
            out += [y.detach(), a.grad, b.grad]
        results[impl] = out
    for i, (a, b) in enumerate(zip(*results.values())):
        same(a, b, f"linear/grouped output or gradient {i}")
    print("all equal")


if __name__ == "__main__":
    _main()
