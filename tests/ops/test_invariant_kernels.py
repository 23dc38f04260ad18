"""rlcli.ops.invariant_kernels (model.batch_invariant on CUDA): values against references, and a
row's bits independent of the rows computed with it.

They run on CUDA. Without CUDA, where triton is installed, ``test_kernels_under_the_interpreter``
runs them in a child process on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1
RLCLI_INVARIANT_KERNELS_ON_CPU=1``; tests/interpreter.py), values and row bits as the interpreter
computes them (its ``tl.dot`` is numpy's matmul). The engine-against-trainer test with these kernels is
``test_batch_invariant.py::test_engine_and_trainer_logprobs_are_bitwise_equal`` (its ``cuda`` cases).
"""

import os

import pytest
import torch
import torch.nn.functional as F

import interpreter
from rlcli.ops import batch_invariant
from rlcli.ops.fp8.quant import dequantize_1x128, dequantize_128x128, quantize_1x128, quantize_128x128

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("RLCLI_INVARIANT_KERNELS_ON_CPU") == "1" and interpreter.ACTIVE:
    DEVICE = "cpu"
else:
    DEVICE = None


@pytest.fixture(autouse=True)
def _on_device(request):
    """Every test but the launcher needs CUDA, or the child process under the interpreter."""
    if request.node.name != "test_kernels_under_the_interpreter":
        if DEVICE is None:
            pytest.skip("needs CUDA; without it test_kernels_under_the_interpreter runs these")
        if not batch_invariant.kernels_available():
            pytest.skip("triton does not import")


@pytest.mark.skipif(DEVICE is not None, reason="the kernels run here directly")
def test_kernels_under_the_interpreter():
    interpreter.run_child_or_skip(__file__, {"RLCLI_INVARIANT_KERNELS_ON_CPU": "1"})


@pytest.fixture(scope="module")
def K():
    if DEVICE is None or not batch_invariant.kernels_available():
        pytest.skip("needs CUDA and triton; without CUDA test_kernels_under_the_interpreter runs these")
    from rlcli.ops import invariant_kernels

    return invariant_kernels


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


ROW_SETS = (1, 3, 17, 64, 65, 130)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_matches_fp64_and_a_row_keeps_its_bits_in_any_batch(K, dtype):
    a, b = _rand(130, 200, dtype=dtype), _rand(72, 200, dtype=dtype, seed=1)
    full = K.mm(a, b)
    ref = a.double() @ b.double().T
    tol = 1e-4 if dtype == torch.float32 else 0.25  # fp32: IEEE products, no TF32
    assert (full.double() - ref).abs().max() < tol
    for m in ROW_SETS:
        assert torch.equal(K.mm(a[:m], b), full[:m]), m
    perm = torch.randperm(130, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    assert torch.equal(K.mm(a[perm], b), full[perm])
    assert torch.equal(K.mm(a[5:6].clone(), b), full[5:6])  # a copy at another address


def test_fp8_mm_matches_the_dequantized_product_and_keeps_row_bits(K):
    x, w = _rand(130, 300), _rand(200, 300, seed=1)
    xq, xs = quantize_1x128(x)
    wq, ws = quantize_128x128(w)
    full = K.fp8_mm(xq, xs, wq, ws, torch.float32)
    ref = dequantize_1x128(xq, xs).double() @ dequantize_128x128(wq, ws).double().T
    # Hopper's FP8 tensor cores add inside a 128-wide K block with fewer than fp32's bits (DeepSeek-V3
    # reports about 14); the block sums then meet in fp32, as in DeepGEMM. Seen: 5.7e-4 of the largest |ref|.
    assert (full.double() - ref).abs().max() < 2e-3 * ref.abs().max()
    xs_col = xs.t().contiguous().t()  # the quantizers' column-major scale layout
    assert torch.equal(K.fp8_mm(xq, xs_col, wq, ws, torch.float32), full)
    for m in ROW_SETS:
        assert torch.equal(K.fp8_mm(xq[:m], xs[:m], wq, ws, torch.float32), full[:m]), m
    if DEVICE == "cuda":  # the interpreter's stores to bf16 truncate
        assert torch.equal(K.fp8_mm(xq, xs, wq, ws, torch.bfloat16), full.bfloat16())


COUNTS = (0, 40, 3, 100, 7)  # rows per expert: an empty one, one smaller than a tile, one spanning tiles


def _offs(counts) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(DEVICE)


def _other_batches(counts):
    """Other batches of the same tokens, as (row indices into the full batch, their offs): every
    expert's first rows only, the last expert's alone, and every second row (the tile boundaries move)."""
    starts = [sum(counts[:g]) for g in range(len(counts))]
    halves = [min(c, 5) for c in counts]
    yield [s + j for s, c in zip(starts, halves) for j in range(c)], halves
    yield list(range(starts[-1], starts[-1] + counts[-1])), [0] * (len(counts) - 1) + [counts[-1]]
    odd = [len(range(1, c, 2)) for c in counts]
    yield [s + j for s, c in zip(starts, counts) for j in range(1, c, 2)], odd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_the_loop_and_a_row_keeps_its_bits_in_any_batch(K, dtype):
    """MoE experts (bf16 and fp32): each token's row against a per-expert fp64 loop, rows past the last
    offset zero, and a token's bits the same whatever else was routed to its expert or to its tile."""
    from rlcli.ops.grouped_gemm import grouped_mm_loop

    R = sum(COUNTS)
    x, w = _rand(R + 4, 200, dtype=dtype), _rand(len(COUNTS), 72, 200, dtype=dtype, seed=1)
    full = K.grouped_mm(x, w, _offs(COUNTS))
    ref = grouped_mm_loop(x.double(), w.double(), _offs(COUNTS))
    tol = 1e-4 if dtype == torch.float32 else 0.25
    assert (full.double() - ref).abs().max() < tol and not full[R:].any()
    for rows, counts in _other_batches(COUNTS):
        idx = torch.tensor(rows, device=DEVICE)
        assert torch.equal(K.grouped_mm(x[idx], w, _offs(counts)), full[idx]), counts


def test_fp8_grouped_mm_matches_the_dequantized_product_and_keeps_row_bits(K):
    from rlcli.ops.fp8.backends import EmulatedBackend

    R = sum(COUNTS)
    x, w = _rand(R, 300), _rand(len(COUNTS), 200, 300, seed=1)
    xq, xs = quantize_1x128(x)
    wq, ws = (torch.stack(t) for t in zip(*(quantize_128x128(w[g]) for g in range(len(COUNTS)))))
    full = K.fp8_grouped_mm(xq, xs, wq, ws, _offs(COUNTS), torch.float32)
    ref = EmulatedBackend().grouped_gemm(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), _offs(COUNTS).cpu(), torch.float64)
    assert (full.cpu().double() - ref).abs().max() < 2e-3 * ref.abs().max()  # as fp8_mm's bound
    assert torch.equal(K.fp8_grouped_mm(xq, xs.t().contiguous().t(), wq, ws, _offs(COUNTS), torch.float32), full)
    for rows, counts in _other_batches(COUNTS):
        idx = torch.tensor(rows, device=DEVICE)
        assert torch.equal(K.fp8_grouped_mm(xq[idx], xs[idx], wq, ws, _offs(counts), torch.float32), full[idx]), counts


@pytest.mark.parametrize("T,D", [(45, 16), (150, 16), (40, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_gives_a_query_the_same_bits_in_every_batch_shape(K, dtype, T, D):
    """As test_batch_invariant's CPU test: a [T, T] causal forward, prefill chunks after cached
    keys, and decode rows next to other sequences whose padding holds huge values. T = 150 spans
    several query tiles and key blocks, and the chunks cut across them; D = 576 is absorbed MLA's
    head (latent 512 + rope 64), which takes smaller tiles."""
    Hq, Hkv = 6, 2
    q, k, v = (_rand(1, h, T, D, dtype=dtype, seed=s) for s, h in enumerate((Hq, Hkv, Hkv)))
    full = K.dense_attention(q, k, v, 0.25, torch.tensor([T]))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.25, enable_gqa=True)
    tol = dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # bf16: an ulp at |x| ~ 2
    torch.testing.assert_close(full.float(), ref, **tol)
    # One query at a time over 150 keys is 150 calls, ~10 s interpreted: there T = 45 covers chunks of 1.
    for chunk in (1, 7, 32, 50) if T < 100 or not interpreter.ACTIVE else (7, 32, 50):
        parts = [K.dense_attention(q[:, :, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk], 0.25,
                             torch.tensor([min(T, s + chunk)])) for s in range(0, T, chunk)]
        assert torch.equal(torch.cat(parts, dim=2), full), chunk
    width = T + 19
    for p in sorted({p for p in (0, 5, 31, 32, 44) if p < T} | {T - 1}):
        kb, vb = (torch.full((3, Hkv, width, D), 1e30, dtype=dtype, device=DEVICE) for _ in range(2))
        kb[1, :, :p + 1], vb[1, :, :p + 1] = k[0, :, :p + 1], v[0, :, :p + 1]
        kb[0], vb[0], kb[2], vb[2] = 0.5, 0.25, -0.5, 1.0
        qb = _rand(3, Hq, 1, D, dtype=dtype, seed=9)
        qb[1] = q[0, :, p:p + 1]
        kb = kb.transpose(1, 2).contiguous().transpose(1, 2)  # the engine's gathered layout
        out = K.dense_attention(qb, kb, vb, 0.25, torch.tensor([7, p + 1, width]))
        assert torch.equal(out[1, :, 0], full[0, :, p]), p
        assert torch.isfinite(out).all()


def test_varlen_attention_reads_keys_through_their_rows(K):
    """The engine's call (keys in a paged cache, read through slots) and the trainer's (a packed
    row) give a query the same bits as the dense call over the same keys."""
    Hq, Hkv, D = 4, 2, 32
    q, k, v = (_rand(1, h, 40, D, dtype=torch.bfloat16, seed=s) for s, h in enumerate((Hq, Hkv, Hkv)))
    dense = K.dense_attention(q, k, v, 0.2, torch.tensor([40]))
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:40].to(DEVICE)  # a "cache": 64 slots
    k_cache = torch.zeros(64, Hkv, D, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_cache[perm], v_cache[perm] = k[0].transpose(0, 1), v[0].transpose(0, 1)
    # Two sequences in one call: a decode of position 39 and a chunk of positions 30..35.
    qs = torch.cat([q[0, :, 39:40], q[0, :, 30:36]], dim=1).transpose(0, 1)
    rows = torch.cat([perm, perm[:36]])
    cu_q, cu_k = torch.tensor([0, 1, 7]), torch.tensor([0, 40, 76])
    out = K.attention(qs, k_cache, v_cache, rows, cu_q, cu_k, 6, 0.2)
    assert torch.equal(out[0], dense[0, :, 39]) and torch.equal(out[1:], dense[0, :, 30:36].transpose(0, 1))


@pytest.mark.parametrize("D,Dv", [(24, 16), (32, 16), (576, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_the_value_a_prefix_of_the_key(K, dtype, D, Dv):
    """Latent MLA's call under the flag: one K/V head, the value the key's first Dv features (a
    view of the cache). A value block narrower than the key block gave wrong outputs in bf16 on the
    H200 (24/16 and 32/16; 576/512 was right) and an illegal memory access in the engine's step."""
    Hq, T = 4, 70
    kv = _rand(T, 1, D, dtype=dtype, seed=1)
    q = _rand(T, Hq, D, dtype=dtype, seed=2)
    out = K.attention(q, kv, kv[..., :Dv], torch.arange(T, device=DEVICE), torch.tensor([0, T]),
                      torch.tensor([0, T]), T, 0.3)
    ref = F.scaled_dot_product_attention(q.double().transpose(0, 1), kv.double().transpose(0, 1).expand(Hq, T, D),
                                         kv[..., :Dv].double().transpose(0, 1).expand(Hq, T, Dv), is_causal=True,
                                         scale=0.3).transpose(0, 1)
    # fp32's rounding grows with the dot products' width (2e-5 at 576 on an H100); a narrow value
    # block was off by up to 2.5.
    tol = dict(atol=1e-5 * max(1, D / 64), rtol=0) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), ref, **tol)


def test_rms_norm_and_row_sum_keep_row_bits(K):
    from rlcli.models.layers import RMSNorm

    x, w = _rand(65, 96, dtype=torch.bfloat16), _rand(96, dtype=torch.bfloat16, seed=1)
    full = K.rms_norm(x, w, 1e-6)
    norm = RMSNorm(96, 1e-6).to(device=DEVICE, dtype=torch.bfloat16)
    norm.weight.data.copy_(w)
    torch.testing.assert_close(full.float(), norm(x).float(), atol=0.07, rtol=0.02)  # a bf16 ulp or so
    e = _rand(65, 3000).abs()
    sums = K.row_sum(e)
    torch.testing.assert_close(sums.double(), e.double().sum(-1), atol=0, rtol=1e-5)
    for m in ROW_SETS[:-1]:
        assert torch.equal(K.rms_norm(x[:m], w, 1e-6), full[:m]), m
        assert torch.equal(K.row_sum(e[:m]), sums[:m]), m


def test_row_cumsum_matches_fp64_and_keeps_row_bits(K):
    e = _rand(65, 3000).abs()
    full = K.row_cumsum(e)
    torch.testing.assert_close(full.double(), e.double().cumsum(-1), atol=0, rtol=1e-5)
    for m in ROW_SETS[:-1]:
        assert torch.equal(K.row_cumsum(e[:m]), full[:m]), m
    assert torch.equal(K.row_cumsum(e[7:8].clone()), full[7:8])


def test_kernel_autograd_matches_torch():
    """The swapped-in modules' forward runs the kernels, their gradients are torch's formulas'."""
    from rlcli.models.layers import RMSNorm

    lin = torch.nn.Linear(64, 48).to(DEVICE)
    norm = RMSNorm(64).to(DEVICE)
    norm.weight.data.uniform_(0.5, 1.5)
    x = _rand(2, 21, 64).requires_grad_()
    ref_y = lin(norm(x))
    ref = torch.autograd.grad(ref_y.pow(2).sum(), (x, lin.weight, lin.bias, norm.weight))
    batch_invariant.make_batch_invariant(torch.nn.Sequential(norm, lin))
    y = lin(norm(x))
    got = torch.autograd.grad(y.pow(2).sum(), (x, lin.weight, lin.bias, norm.weight))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    q, k, v = (_rand(1, h, 20, 16, seed=s).requires_grad_() for s, h in enumerate((4, 2, 2)))
    out = batch_invariant.invariant_attention(q, k, v, 0.25, torch.tensor([20]))
    got = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    ref_out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    ref = torch.autograd.grad(ref_out.pow(2).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
