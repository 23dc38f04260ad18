"""rlcli.ops.fused_kernels (the native engine's fused norms and rotary, and SwiGLU's gate both ways, on
CUDA) against the torch code they replace: in fp32 to float rounding, in half precision to at most two
steps of the dtype (one step in an intermediate rounding, scaled by the weight's product) on the few
elements whose fp32 value lands on a rounding edge, and the residual add bit for bit; on CUDA the
SwiGLU gate and its gradients bit for bit.

They run on CUDA. Without CUDA, where triton is installed and its interpreter works,
``test_under_the_interpreter`` runs this file in a child process on CPU tensors under Triton's
interpreter, and ``test_zoo_under_the_interpreter`` (on CUDA hosts too) runs
tests/models/test_fused_layers.py so: every architecture's forward with the fused layers.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import interpreter
from rlcli.models.layers import RMSNorm, RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu" if interpreter.ACTIVE else None
TESTS = Path(__file__).resolve().parent.parent
# Half precision on CUDA; the interpreter's bf16 is numpy's emulation, so there fp32 and fp16.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _kernels():
    if DEVICE is None:
        pytest.skip("needs CUDA; without it test_under_the_interpreter runs these")
    try:
        from rlcli.ops import fused_kernels
    except (ImportError, OSError):
        pytest.skip("triton does not import")
    return fused_kernels


@pytest.mark.skipif(DEVICE is not None, reason="the kernels run here directly")
def test_under_the_interpreter():
    interpreter.run_child_or_skip(__file__)


@pytest.mark.skipif(interpreter.ACTIVE, reason="the launcher of a child run")
def test_zoo_under_the_interpreter():
    interpreter.run_child_or_skip(str(TESTS / "models" / "test_fused_layers.py"))


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: equal to float rounding. Half precision: at most two steps of the dtype apart, on at
    most 2% of the elements."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        return
    g, w = got.double(), want.double()
    step = torch.finfo(want.dtype).eps * w.abs().clamp_min(torch.finfo(want.dtype).tiny)
    off = (g - w).abs()
    assert (off <= 2 * step).all(), f"more than two steps apart: {(off / step).max()}"
    assert (off > 0).double().mean() <= 0.02, f"{(off > 0).double().mean():.3%} of the elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 576, 2048, 5120])
@torch.no_grad()
def test_rms_norm_with_and_without_the_residual(dtype, width):
    k = _kernels()
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(37, width, generator=gen) * 3).to(DEVICE, dtype)
    r = torch.randn(37, width, generator=gen).to(DEVICE, dtype)
    norm = RMSNorm(width, eps=1e-6).to(DEVICE, dtype)
    norm.weight.copy_(torch.randn(width, generator=gen))
    none, y = k.add_rms_norm(x, None, norm.weight, norm.eps)
    assert none is None
    assert_close(y, norm(x))
    h, y = k.add_rms_norm(x, r, norm.weight, norm.eps)
    assert torch.equal(h, x + r)  # the stream is bit for bit the torch add
    assert_close(y, norm(x + r))


@torch.no_grad()
def test_rms_norm_of_strided_rows():
    """MLA's latent norm takes a slice of a wider projection: rows at a stride, left in place."""
    k = _kernels()
    wide = torch.randn(2, 9, 576, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = wide[..., :512]
    norm = RMSNorm(512).to(DEVICE)
    norm.weight.copy_(torch.rand(512, generator=torch.Generator().manual_seed(2)) + 0.5)
    y = k.add_rms_norm(x, None, norm.weight, norm.eps)[1]
    assert y.shape == x.shape
    assert_close(y, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@torch.no_grad()
def test_rotary_in_place_matches_the_zoos(dtype, qk_norm, head_dim):
    """Queries and keys of 5 tokens at scattered positions (8 and 2 heads), rotated in place, after
    Qwen3's per-head norms or not."""
    k = _kernels()
    gen = torch.Generator().manual_seed(head_dim)
    T, HQ, HK = 5, 8, 2
    rope = RotaryEmbedding(head_dim, 1e6, None, 4096).to(DEVICE)
    rope.init_buffers()
    pos = torch.tensor([[0, 3, 17, 900, 4000]], device=DEVICE)
    cos, sin = rope(pos, dtype)
    q = (torch.randn(1, T, HQ * head_dim, generator=gen) * 2).to(DEVICE, dtype).view(1, T, HQ, head_dim)
    kk = (torch.randn(1, T, HK * head_dim, generator=gen) * 2).to(DEVICE, dtype).view(1, T, HK, head_dim)
    if qk_norm:
        qn, kn = RMSNorm(head_dim).to(DEVICE, dtype), RMSNorm(head_dim).to(DEVICE, dtype)
        qn.weight.copy_(torch.rand(head_dim, generator=gen) + 0.5)
        kn.weight.copy_(torch.rand(head_dim, generator=gen) + 0.5)
        want_q, want_k = rope.apply(qn(q), cos, sin), rope.apply(kn(kk), cos, sin)
        k.rotary_(q, kk, cos, sin, qn.weight, kn.weight, eps=qn.eps)
    else:
        want_q, want_k = rope.apply(q, cos, sin), rope.apply(kk, cos, sin)
        k.rotary_(q, kk, cos, sin)
    assert_close(q, want_q)
    assert_close(kk, want_k)


@pytest.mark.parametrize("qk_norm", [False, True])
@torch.no_grad()
def test_rotary_writes_keys_and_values_to_their_cache_slots(qk_norm):
    """With ``store``, each token's rotated key (the one left in ``k``) and its value land in its slot
    of the paged caches; every other slot keeps what it held."""
    k = _kernels()
    gen = torch.Generator().manual_seed(9)
    T, HQ, HK, D, blocks, bs = 6, 4, 2, 32, 5, 4
    rope = RotaryEmbedding(D, 1e4, None, 256).to(DEVICE)
    rope.init_buffers()
    cos, sin = rope(torch.arange(T, device=DEVICE)[None] * 7, torch.float32)
    q = torch.randn(1, T, HQ, D, generator=gen).to(DEVICE)
    kk = torch.randn(1, T, HK, D, generator=gen).to(DEVICE)
    v = torch.randn(1, T, HK, D, generator=gen).to(DEVICE)
    k_cache = torch.randn(blocks, bs, HK, D, generator=gen).to(DEVICE)
    v_cache = torch.randn(blocks, bs, HK, D, generator=gen).to(DEVICE)
    before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, 2, 9, 3, 12, 0], device=DEVICE)
    norms = (torch.rand(D, generator=gen).to(DEVICE) + 0.5, torch.rand(D, generator=gen).to(DEVICE) + 0.5) \
        if qk_norm else ()
    k.rotary_(q, kk, cos, sin, *norms, eps=1e-6, store=(v, k_cache, v_cache, slots))
    want_k, want_v = [c.view(-1, HK, D).clone() for c in before]
    want_k[slots], want_v[slots] = kk[0], v[0]
    assert torch.equal(k_cache.view(-1, HK, D), want_k) and torch.equal(v_cache.view(-1, HK, D), want_v)
    q3, k3 = torch.randn(1, T, HQ, D, generator=gen).to(DEVICE), torch.randn(1, T, HK, D, generator=gen).to(DEVICE)
    r3 = q3.clone(), k3.clone()
    k.rotary_(q3, k3, cos, sin, *norms, eps=1e-6)  # the same rotation without the store
    k.rotary_(*r3, cos, sin, *norms, eps=1e-6, store=(v, k_cache, v_cache, slots))
    assert torch.equal(r3[0], q3) and torch.equal(r3[1], k3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 96), (33, 3000), (1, 1024), (5, 3072)])
@torch.no_grad()
def test_silu_mul(dtype, shape):
    k = _kernels()
    gen = torch.Generator().manual_seed(shape[1])
    g = (torch.randn(*shape, generator=gen) * 4).to(DEVICE, dtype)
    u = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    if DEVICE == "cuda":  # libdevice's exp and IEEE divisions, torch's roundings
        assert torch.equal(k.silu_mul(g, u), F.silu(g) * u)
    else:
        assert_close(k.silu_mul(g, u), F.silu(g) * u)


def _swiglu_grads(fn, g, u, dh):
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = fn(g, u)
    h.backward(dh)
    return h, g.grad, u.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 96), (33, 3000), (2, 5, 1024), (3, 2048)])
def test_swiglu_forward_and_backward_against_torch(dtype, shape):
    """rlcli.ops.swiglu's kernels against autograd through ``F.silu(g) * u``: on CUDA the output and
    both gradients bit for bit (libdevice's exp and IEEE divisions, torch's roundings); under the
    interpreter (Triton's exp) to float rounding, or two steps of a half-precision dtype."""
    _kernels()
    from rlcli.ops import swiglu

    assert swiglu._kernels() is not None
    gen = torch.Generator().manual_seed(shape[-1])
    g = (torch.randn(*shape, generator=gen) * 4).to(DEVICE, dtype)
    u = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    dh = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    got = _swiglu_grads(swiglu.SwiGLUFn.apply, g, u, dh)
    want = _swiglu_grads(lambda a, b: F.silu(a) * b, g, u, dh)
    for x, y in zip(got, want):
        if DEVICE == "cuda":
            assert torch.equal(x, y), f"{(x != y).sum().item()} elements differ"
        else:
            assert_close(x, y)
    if DEVICE == "cuda":
        assert swiglu.swiglu(g.requires_grad_(), u).grad_fn.name() == "SwiGLUFnBackward"  # the zoo's MLPs take the kernels


def test_swiglu_reads_strided_halves():
    """Gate and up as the two halves of one stacked projection's output (rows strided by twice the
    width), and a strided gradient."""
    _kernels()
    from rlcli.ops import swiglu

    swiglu._kernels()
    gen = torch.Generator().manual_seed(5)
    both = (torch.randn(9, 2 * 160, generator=gen) * 3).to(DEVICE)
    dh = torch.randn(160, 9, generator=gen).to(DEVICE).t()
    got = _swiglu_grads(swiglu.SwiGLUFn.apply, both[:, :160], both[:, 160:], dh)
    want = _swiglu_grads(lambda a, b: F.silu(a) * b, both[:, :160], both[:, 160:], dh)
    for x, y in zip(got, want):
        assert_close(x, y)


@torch.no_grad()
def test_empty_inputs():
    k = _kernels()
    x = torch.empty(0, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    assert k.add_rms_norm(x, x, w, 1e-6)[1].shape == (0, 64)
    assert k.silu_mul(x, x).shape == (0, 64)
    q = torch.empty(1, 0, 4, 16, device=DEVICE)
    k.rotary_(q, q[:, :, :2], torch.empty(1, 0, 16, device=DEVICE), torch.empty(1, 0, 16, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32])
@pytest.mark.parametrize("vocab", [97, 4096, 151936])
@torch.no_grad()
def test_the_sampling_kernel_draws_what_the_torch_chain_draws(dtype, vocab):
    """rlcli.ops.sampling_kernel against sample()'s torch chain (forced by a top-p of 1) at the same
    uniforms: the same tokens, the same logprobs to float rounding; greedy rows (T = 0) the argmax,
    the first of tied maxima, with log_softmax's logprob."""
    _kernels()
    from rlcli.ops import sampling_kernel
    from rlcli.ops.sampling import sample

    S = 12
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(S, vocab, generator=gen) * 3).to(DEVICE, dtype)
    logits[3, 5] = logits[3, vocab - 2] = logits[3].max() + 1  # a tie for the greedy row below
    temps = torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 0.0, 2.0, 0.5, 1.0, 1.0, 0.9, 1.1], device=DEVICE)
    seeded = torch.Generator(DEVICE).manual_seed(11)
    want_tok, want_lp = sample(logits, temps, torch.ones(S, device=DEVICE), seeded, any_top_p=True)
    u = torch.rand(S, 1, generator=torch.Generator(DEVICE).manual_seed(11), dtype=torch.float64, device=DEVICE)
    tok, lp = sampling_kernel.sample_rows(logits, temps, u)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(tok, want_tok)
    assert tok[3] == 5
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_sampling_kernel_takes_the_last_token_and_never_a_zero():
    """u at its largest (torch.rand's is 1 - 2^-53) takes the last token of positive probability, not
    the zero-probability ones after it; u at 0 the first of positive probability."""
    _kernels()
    from rlcli.ops import sampling_kernel

    logits = torch.full((2, 300), -1e4, device=DEVICE)
    logits[0, 7] = logits[0, 100] = 0.0
    logits[1, 299] = 0.0
    ones = torch.ones(2, device=DEVICE)
    u = torch.tensor([[1 - 2**-53], [0.5]], dtype=torch.float64, device=DEVICE)
    assert sampling_kernel.sample_rows(logits, ones, u)[0].tolist() == [100, 299]
    assert sampling_kernel.sample_rows(logits, ones, torch.zeros_like(u))[0].tolist() == [7, 299]
