"""FP8 block quantization, the emulated GEMM backend, and the FP8 linear's autograd recipe.

Error model used for every bound here. e4m3fn has 3 mantissa bits: rounding a normal value
to nearest is off by at most u = 2^-4 of it; below 2^-6 (subnormals) the spacing is 2^-9,
so the error is at most 2^-10 absolute. Scaled by the block scale s, one element's error is

    e(x) <= u |x| + 2^-10 s        (s = amax(block) / 448)

and a dot product of two quantized vectors is off by at most
sum_k e(a_k)|b_k| + |a_k| e(b_k) + e(a_k) e(b_k), i.e. E_a |B| + |A| E_b + E_a E_b as matrices
(~2u = 12.5% of sum |a||b| in the worst case; for random signs the typical error is
~sqrt(2/3) u ~ 4% of the result's norm). bf16 (8 mantissa bits) has u = 2^-8 and no
block term. The tests check every element against these bounds, plus fp32 accumulation.
"""

import pytest
import torch
import torch.nn.functional as F

from rlcli.ops.fp8.backends import EmulatedBackend, make_backend
from rlcli.ops.fp8.linear import FP8Linear, fp8_grouped_mm, fp8_linear
from rlcli.ops.fp8.quant import (
    FP8_DTYPE, dequantize_1x128, dequantize_128x128, quantize_1x128, quantize_128x128, transpose_blocks,
)

U_FP8, U_BF16, SUB = 2.0 ** -4, 2.0 ** -8, 2.0 ** -10


def ref_scales(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-element amax/448 of each (rows x 128) block, computed by plain loops (independent of quant.py)."""
    x = x.double()
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], 128):
            blk = x[i:i + rows, j:j + 128]
            out[i:i + rows, j:j + 128] = blk.abs().max().clamp(min=1e-12) / 448.0
    return out


def err_bound(x: torch.Tensor, rows: int, u: float = U_FP8) -> torch.Tensor:
    return u * x.double().abs() + SUB * ref_scales(x, rows) if u == U_FP8 else u * x.double().abs()


def product_bound(a, ea, b, eb) -> torch.Tensor:
    """Bound on |(A+dA)(B+dB)^T - AB^T| for |dA| <= ea, |dB| <= eb (all [*, K])."""
    A, B = a.double().abs(), b.double().abs()
    return ea @ B.T + A @ eb.T + ea @ eb.T + 1e-6 * (A @ B.T)  # last term: fp32 accumulation


def data(*shape, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if outliers:  # a few large channels, as real activations have: block scaling must contain them
        x[..., 3] *= 50
    return x


@pytest.mark.parametrize("shape", [(256, 384), (200, 190), (5, 130)])
def test_quantization_round_trip_within_bounds(shape):
    x = data(*shape)
    q, s = quantize_1x128(x)
    assert q.dtype == FP8_DTYPE and s.shape == (shape[0], -(-shape[1] // 128))
    assert torch.allclose(s.repeat_interleave(128, 1)[:, :shape[1]].double(), ref_scales(x, 1), rtol=1e-6)
    assert ((dequantize_1x128(q, s).double() - x.double()).abs() <= err_bound(x, 1) * (1 + 1e-6)).all()

    q, s = quantize_128x128(x)
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert ((dequantize_128x128(q, s).double() - x.double()).abs() <= err_bound(x, 128) * (1 + 1e-6)).all()


def test_ue8m0_scales_are_powers_of_two_covering_the_block_max():
    x = data(130, 300)
    q, s = quantize_128x128(x, ue8m0=True)
    exact = ref_scales(x, 128)[::128, ::128].float()
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))
    assert (s >= exact).all() and (s < 2 * exact).all()
    assert q.float().abs().max() <= 448
    err = (dequantize_128x128(q, s).double() - x.double()).abs()
    assert (err <= U_FP8 * x.double().abs() + SUB * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
            [:130, :300].double() * (1 + 1e-6)).all()


def test_transposed_blocks_equal_quantizing_the_transpose():
    w = data(200, 330)
    qt, st = transpose_blocks(*quantize_128x128(w))
    q2, s2 = quantize_128x128(w.T.contiguous())
    assert torch.equal(qt.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(st, s2)


def test_all_zero_block_quantizes_to_zero():
    x = torch.zeros(3, 256)
    x[:, 128:] = 1.0
    q, s = quantize_1x128(x)
    assert torch.isfinite(s).all() and (dequantize_1x128(q, s)[:, :128] == 0).all()


@pytest.mark.parametrize("M,N,K", [(64, 256, 384), (37, 190, 200)])
def test_emulated_gemm_equals_float64_of_dequantized_operands(M, N, K):
    be = EmulatedBackend()
    (aq, sa), (bq, sb) = quantize_1x128(data(M, K, seed=1)), quantize_128x128(data(N, K, seed=2))
    a64, b64 = dequantize_1x128(aq, sa).double(), dequantize_128x128(bq, sb).double()
    ref = a64 @ b64.T
    out = be.gemm(aq, sa, bq, sb, torch.float32).double()
    assert ((out - ref).abs() <= 2 * K * 2.0 ** -24 * (a64.abs() @ b64.abs().T) + 1e-30).all()
    (b1, s1) = quantize_1x128(data(N, K, seed=3))
    ref = a64 @ dequantize_1x128(b1, s1).double().T
    out = be.gemm_1x128(aq, sa, b1, s1, torch.float32).double()
    assert ((out - ref).abs() <= 2 * K * 2.0 ** -24 * (a64.abs() @ dequantize_1x128(b1, s1).double().abs().T)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's blockwise scaled_mm runs on CUDA (SM90)")
@pytest.mark.parametrize("M,N,K", [(5, 96, 128), (200, 96, 96), (130, 320, 200)])
def test_torch_backend_takes_shapes_cublaslt_has_no_algorithm_for(M, N, K):
    """A 128-wide MoE's experts (N or K of 96, a single K block, ragged rows) against the emulated
    product: cuBLASLt refused them before the backend padded rows (CUBLAS_STATUS_NOT_SUPPORTED)."""
    be, ref_be = make_backend("torch", "cuda"), EmulatedBackend()
    (aq, sa), (bq, sb) = quantize_1x128(data(M, K, seed=1).cuda()), quantize_128x128(data(N, K, seed=2).cuda())
    ref = ref_be.gemm(aq.cpu(), sa.cpu(), bq.cpu(), sb.cpu(), torch.float32)
    torch.testing.assert_close(be.gemm(aq, sa, bq, sb, torch.float32).cpu(), ref, atol=2e-3 * ref.abs().max(), rtol=0)
    (b1, s1) = quantize_1x128(data(N, K, seed=3).cuda())
    ref = ref_be.gemm_1x128(aq.cpu(), sa.cpu(), b1.cpu(), s1.cpu(), torch.float32)
    out = be.gemm_1x128(aq, sa, b1, s1, torch.float32).cpu()
    torch.testing.assert_close(out, ref, atol=2e-3 * ref.abs().max(), rtol=0)
    # Experts: one of exactly 128 rows starting at row 5 (its scales' slice starts off 16 bytes).
    (xq, xs), w = quantize_1x128(data(M + 133, K, seed=4).cuda()), data(3, N, K, seed=5).cuda()
    wq, ws = (torch.stack(t) for t in zip(*(quantize_128x128(w[g]) for g in range(3))))
    offs = torch.tensor([5, 133, M + 133], dtype=torch.int32, device="cuda")
    ref = ref_be.grouped_gemm(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), offs.cpu(), torch.float32)
    out = be.grouped_gemm(xq, xs, wq, ws, offs, torch.bfloat16).float().cpu()
    torch.testing.assert_close(out, ref, atol=1e-2 * ref.abs().max(), rtol=0)


def test_backend_factory_on_cpu():
    assert make_backend("auto", "cpu").name == "emulated"
    from rlcli.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8.backend"):  # one line naming the key, exit 2
        make_backend("torch", "cpu")


def test_scales_reach_scaled_mm_column_major_even_for_one_k_block():
    """torch's blockwise scaled_mm checks scale strides (1, rows) even when K fits one block (a
    128-wide model's MoE experts failed there with "scale_a must have strides (1, 128); got [1, 4]")."""
    from rlcli.ops.fp8.backends import _col_major

    one_block = torch.rand(512).as_strided((128, 1), (1, 4))
    assert _col_major(one_block).stride() == (1, 128) and torch.equal(_col_major(one_block), one_block)
    expert_rows = torch.rand(300, 1)[5:133]  # an expert's 128 rows, 20 bytes into the batch's scales
    assert _col_major(expert_rows).stride() == (1, 128) and _col_major(expert_rows).data_ptr() % 16 == 0
    assert torch.equal(_col_major(expert_rows), expert_rows)
    row_major = torch.rand(128, 3)
    assert _col_major(row_major).stride() == (1, 128) and torch.equal(_col_major(row_major), row_major)
    col_major = row_major.t().contiguous().t()
    assert _col_major(col_major).data_ptr() == col_major.data_ptr()


def _grads(fn, x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("M,N,K", [(256, 384, 256), (300, 190, 200)])
def test_fp8_linear_forward_and_gradients_within_recipe_bounds(M, N, K):
    """y, dX, dW of the FP8 linear (DeepSeek-V3 recipe) against exact float64, element by element,
    and against a bf16 linear: |fp8 - bf16| <= fp8 bound + bf16 bound."""
    x, w, dy = data(M, K, seed=1), data(N, K, seed=2, outliers=False) * 0.05, data(M, N, seed=3, outliers=False)
    be = EmulatedBackend()
    y8, dx8, dw8 = _grads(lambda a, b: fp8_linear(a, b, None, be), x, w, dy)
    yb, dxb, dwb = (t.double() for t in _grads(lambda a, b: F.linear(a.bfloat16(), b.bfloat16()).float(), x, w, dy))
    X, W, DY = x.double(), w.double(), dy.double()
    checks = {  # name: (fp8 value, bf16 value, exact, fp8 bound, bf16 bound)
        "y": (y8, yb, X @ W.T, product_bound(x, err_bound(x, 1), w, err_bound(w, 128)),
              product_bound(x, err_bound(x, 1, U_BF16), w, err_bound(w, 128, U_BF16))),
        "dx": (dx8, dxb, DY @ W, product_bound(dy, err_bound(dy, 1), w.T, err_bound(w.T.contiguous(), 128)),
               product_bound(dy, err_bound(dy, 1, U_BF16), w.T, err_bound(w.T.contiguous(), 128, U_BF16))),
        "dw": (dw8, dwb, DY.T @ X, product_bound(dy.T, err_bound(dy.T.contiguous(), 1), x.T,
                                                 err_bound(x.T.contiguous(), 1)),
               product_bound(dy.T, err_bound(dy.T.contiguous(), 1, U_BF16), x.T,
                             err_bound(x.T.contiguous(), 1, U_BF16))),
    }
    for name, (v8, vb, exact, b8, bb) in checks.items():
        bb = bb + U_BF16 * (exact.abs() + bb)  # the bf16 linear also rounds its output
        assert ((v8.double() - exact).abs() <= b8).all(), name
        assert ((vb - exact).abs() <= bb).all(), name
        assert ((v8.double() - vb).abs() <= b8 + bb).all(), name
        rel = float((v8.double() - exact).norm() / exact.norm())
        assert rel < 0.06, (name, rel)  # typical error ~4%: the bound above is not vacuous


def test_fp8_linear_module_swaps_in_and_caches_weight():
    lin = torch.nn.Linear(256, 130, bias=True)
    fp8 = FP8Linear.from_linear(lin, EmulatedBackend())
    assert fp8.weight is lin.weight and set(fp8.state_dict()) == {"weight", "bias"}
    x = data(4, 7, 256)
    assert fp8(x).shape == (4, 7, 130)
    key = fp8.cache.key
    fp8(x.requires_grad_()).sum().backward()  # a second forward and the backward reuse the FP8 weight
    assert fp8.cache.key == key and fp8.cache.qt is not None
    x = x.detach()
    with torch.no_grad():
        y = fp8(x)
        assert fp8.cache.key == key
        with torch.inference_mode():  # inference tensors have no version counter: nothing cached on them
            assert torch.equal(fp8(x), y) and torch.equal(fp8(x.clone()), y)
        lin.weight.add_(1.0)  # an in-place load bumps the version: the FP8 copy is refreshed
        fp8(x)
        assert fp8.cache.key != key
    fp8.to_fp8_storage()
    assert fp8.weight.dtype == FP8_DTYPE and fp8.weight_scale_inv.shape == (2, 2)
    assert torch.allclose(fp8(x), fp8_linear(x, lin.weight, lin.bias, EmulatedBackend()), atol=1e-5)


@pytest.mark.parametrize("opt", ["fused", "foreach", "sgd"])
def test_weight_cache_is_invalidated_by_optimizer_step(opt):
    """The cached FP8 weight serves every use within a step and is requantized after optimizer.step,
    also for fused AdamW, which updates parameters without bumping their version counter."""
    lin = torch.nn.Linear(256, 256, bias=False)
    fp8 = FP8Linear.from_linear(lin, EmulatedBackend())
    make = {"fused": lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
            "foreach": lambda p: torch.optim.AdamW(p, lr=0.05, foreach=True),
            "sgd": lambda p: torch.optim.SGD(p, lr=5.0)}[opt]
    optim = make(fp8.parameters())
    x = data(16, 256)
    for _ in range(3):
        y = fp8(x)
        fresh = fp8_linear(x, lin.weight.detach().clone(), None, EmulatedBackend())  # quantized from scratch
        assert torch.equal(y, fresh)
        y.pow(2).mean().backward()
        before = fp8(x).detach()
        optim.step()
        optim.zero_grad()
        assert not torch.equal(fp8(x), before)  # the weight moved: a stale cache would give `before`


def test_grouped_fp8_matches_per_group_fp8_linear_and_gradients():
    G, N, K = 4, 130, 200
    offs = torch.tensor([50, 50, 180, 300], dtype=torch.int32)  # group 1 is empty
    x, w, dy = data(300, K, seed=1), data(G, N, K, seed=2) * 0.05, data(300, N, seed=3)
    be = EmulatedBackend()
    y, dx, dw = _grads(lambda a, b: fp8_grouped_mm(a, b, offs, be), x, w, dy)
    bounds = [0, 50, 50, 180, 300]
    for g in range(G):
        s, e = bounds[g], bounds[g + 1]
        if e == s:
            assert (dw[g] == 0).all()
            continue
        yg, dxg, dwg = _grads(lambda a, b: fp8_linear(a, b, None, be), x[s:e], w[g], dy[s:e])
        torch.testing.assert_close(y[s:e], yg, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx[s:e], dxg, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dw[g], dwg, rtol=1e-5, atol=1e-5)


def test_grouped_fp8_bf16_weight_gradient_is_one_kgrouped_gemm():
    """bf16 experts: dW of every expert is dy_g^T x_g from one k-grouped bf16 GEMM (no per-expert FP8
    loop); forward and dx stay FP8 and match the fp32 path's rounding of the same operands."""
    G, N, K = 4, 128, 256
    offs = torch.tensor([50, 50, 180, 300], dtype=torch.int32)
    x, w, dy = data(300, K, seed=1).bfloat16(), (data(G, N, K, seed=2) * 0.05).bfloat16(), data(300, N, seed=3)
    be = EmulatedBackend()
    y, dx, dw = _grads(lambda a, b: fp8_grouped_mm(a, b, offs, be), x, w, dy.bfloat16())
    assert dw.dtype == torch.bfloat16
    bounds = [0, 50, 50, 180, 300]
    for g in range(G):
        s, e = bounds[g], bounds[g + 1]
        ref = dy[s:e].bfloat16().double().T @ x[s:e].double()
        torch.testing.assert_close(dw[g].double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()) + 1e-6)
        y32 = fp8_linear(x[s:e].float(), w[g].float(), None, be)
        torch.testing.assert_close(y[s:e].float(), y32, rtol=1e-2, atol=1e-2)


def test_rows_quantized_into_a_padded_layout_equal_the_scattered_reference():
    """``quantize_rows_to`` (DeepGEMM's padded grouped layout, torch path here) puts exactly
    ``quantize_1x128``'s rows at the mapped rows, with column-major scales."""
    from rlcli.ops.fp8 import runtime

    x = data(300, 200, seed=4).bfloat16()
    row_map = torch.randperm(520, generator=torch.Generator().manual_seed(0))[:300]
    for ue8m0 in (False, True):
        q, s = runtime.quantize_rows_to(x, ue8m0, row_map, 520)
        rq, rs = quantize_1x128(x, ue8m0)
        assert q.shape == (520, 200) and q.dtype == FP8_DTYPE and s.shape == (520, 2) and s.stride() == (1, 520)
        assert torch.equal(q[row_map].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s[row_map], rs)


def test_grouped_gemm_from_high_precision_rows_equals_quantize_then_grouped():
    """``grouped_gemm_x`` (the MoE training entry) is the grouped GEMM of ``x``'s 1x128 quantization."""
    G, N, K = 4, 130, 200
    offs = torch.tensor([50, 50, 180, 300], dtype=torch.int32)
    x, w = data(300, K, seed=1), data(G, N, K, seed=2) * 0.05
    be = EmulatedBackend()
    (xq, xs), (wq, ws) = quantize_1x128(x), quantize_128x128(w)
    ref = be.grouped_gemm(xq, xs, wq, ws, offs, torch.float32)
    assert torch.equal(be.grouped_gemm_x(x, False, wq, ws, offs, torch.float32), ref)


def _deep_gemm_sm90():
    from rlcli.ops.fp8.backends import _is_sm90, import_deep_gemm

    return torch.cuda.is_available() and _is_sm90(torch.device("cuda")) and import_deep_gemm() is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _deep_gemm_sm90(), reason="needs DeepGEMM on an SM90 GPU")
def test_deep_gemm_wgrad_kernel_is_measured_once_for_every_shape():
    """The first weight gradient times DeepGEMM's 1D1D kernel against scaled_mm; later shapes take the
    winner without a measurement of their own (each one cost a DeepGEMM JIT compile and host syncs)."""
    from rlcli.ops.fp8.backends import DeepGemmBackend, import_deep_gemm

    be, ref = DeepGemmBackend(import_deep_gemm(), strict=True), EmulatedBackend()
    for n, k in [(256, 384), (512, 256), (384, 640)]:
        (aq, sa) = quantize_1x128(data(n, 1024, seed=n).cuda())
        (bq, sb) = quantize_1x128(data(k, 1024, seed=k).cuda())
        out = be.gemm_1x128(aq, sa, bq, sb, torch.float32)
        expected = ref.gemm_1x128(aq, sa, bq, sb, torch.float32)
        assert ((out - expected).norm() / expected.norm()).item() < 1e-2, (n, k)
    assert len(be.wgrad_ms) == 1 and len(be.wgrad_choice) == 3
    assert set(be.wgrad_choice.values()) == {be.wgrad_kernel}


def test_a_deep_gemm_call_on_a_new_shape_keeps_the_process_alive_to_its_peers(tmp_path):
    """DeepGEMM compiles a kernel on a shape's first use (tens of seconds with nvcc), inside an engine or
    trainer step, where the work loop cannot beat: the H200 loop run saw rl-infer called dead seven
    times in its first minutes, and its requests re-dispatched. The first call of each shape extends the
    registration's promise before it runs; calls of a shape already run leave the entry alone."""
    import time
    from types import SimpleNamespace

    from rlcli.ops.fp8.backends import JIT_COMPILE_S, DeepGemmBackend
    from rlcli.transport.registry import Registration, list_entries, read_entry

    reg = Registration(tmp_path, "infer", 0, {"rpc": "tcp://h:1"})
    seen = []

    def fp8_gemm_nt(a, b, out, c=None, recipe=None):  # where the compile would run: what peers see now
        seen.append([e.busy_until for e in list_entries(tmp_path, "infer", stale_after=0.0)])

    be = DeepGemmBackend(SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt), strict=True)
    (aq, sa), (bq, sb) = quantize_1x128(data(4, 256)), quantize_128x128(data(256, 256, seed=1))
    be.gemm(aq, sa, bq, sb, torch.float32)  # no registration takes notices yet: nothing is promised
    assert seen == [[]]
    reg.take_long_op_notices()
    (aq8, sa8) = quantize_1x128(data(8, 256, seed=2))
    t0 = time.time()
    be.gemm(aq8, sa8, bq, sb, torch.float32)  # a new M: alive to a peer with no patience at all
    assert len(seen[1]) == 1 and seen[1][0] >= t0 + JIT_COMPILE_S - 1
    reg.beat()  # the loop's next ordinary beat withdraws the promise
    written = read_entry(tmp_path / "infer-0.json").heartbeat
    be.gemm(aq8, sa8, bq, sb, torch.float32)  # that shape again: no compile, no promise, no write
    assert seen[2] == [] and read_entry(tmp_path / "infer-0.json").heartbeat == written
    reg.close()
    be.gemm(*quantize_1x128(data(16, 256, seed=3)), bq, sb, torch.float32)  # a closed registration takes none
    assert seen[3] == []


def test_deep_gemm_weight_gradients_leave_the_token_count_out_of_the_compiled_kernel():
    """A weight gradient's K is the micro-batch's token count, new at almost every micro-batch of an RL
    step: DeepGEMM is asked to compile M and N only (K a runtime argument), and a build whose
    fp8_gemm_nt takes no compiled_dims still computes them (compiling per K, as before)."""
    from types import SimpleNamespace

    from rlcli.ops.fp8.backends import DeepGemmBackend

    calls = []

    def new_api(a, b, d, c=None, recipe=None, compiled_dims="nk"):
        calls.append(compiled_dims)
        d += 1

    def old_api(a, b, d, c=None, recipe=None):
        calls.append("old")
        d += 2

    (aq, sa), (bq, sb) = quantize_1x128(data(256, 384)), quantize_1x128(data(128, 384, seed=1))
    be = DeepGemmBackend(SimpleNamespace(fp8_gemm_nt=new_api), strict=True)
    assert torch.equal(be._wgrad_1d1d(aq, sa, bq, sb), torch.ones(256, 128))
    be = DeepGemmBackend(SimpleNamespace(fp8_gemm_nt=old_api), strict=True)
    assert torch.equal(be._wgrad_1d1d(aq, sa, bq, sb), torch.full((256, 128), 2.0))
    be._wgrad_1d1d(aq, sa, bq, sb)  # asked once, then called the old way directly
    assert calls == ["mn", "old", "old"]
