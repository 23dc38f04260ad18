"""Fused elementwise kernels on CUDA (Triton): the native engine's forward, and SwiGLU's gate both ways.

A decode step of a small or mid-sized model is bound by its many small kernels, not by its GEMMs.
In torch, one RMSNorm is seven kernels (cast, square, mean, add, rsqrt, product, cast back, then the
weight), a rotary embedding five per tensor, Qwen3's per-head query and key norms seven each, and
SwiGLU's gate two: a graphed Qwen3-0.6B decode step at 256 sequences ran ~1,100 kernels, ~40 a
layer, most of them elementwise and a few microseconds each (H200, docs/benchmarks.md). Each
function here is one of those patterns in one kernel:

- :func:`add_rms_norm`: ``h = x + residual`` and ``rms_norm(h)``, or the norm of ``x`` alone;
- :func:`rotary_`: queries and keys rotated in place (the half-split layout, whole heads), after
  Qwen3's per-head RMSNorm where its weights are given;
- :func:`silu_mul`: SwiGLU's ``silu(gate) * up``, and :func:`silu_mul_backward` its gradients
  (the trainer's, through :func:`rlcli.ops.swiglu.swiglu`).

They round where the torch code they replace rounds: every intermediate that code casts to the
activation dtype (each product and sum of the rotary, the normalized row before its weight, the
SiLU before its product, each gradient of that product) is cast here too. The norms and the rotary
differ in fp32 only: the order of the sum of squares, one over its root where torch takes ``rsqrt``.
So an output can differ from the module's where an fp32 value lands on a rounding edge of its
dtype, by a step of it (two after a weight's product); tests/ops/test_fused_kernels.py bounds that.
The SwiGLU kernels compute what torch's do in the same order, with CUDA's ``expf`` (libdevice) and
IEEE divisions. The rotary kernel is compiled without fused multiply-adds (``enable_fp_fusion=False``):
with them, a product that torch rounds was contracted into the sum unrounded, and half-precision
rotations landed several steps off torch's where the two terms nearly cancel (found on an H100).

Under ``TRITON_INTERPRET=1`` they run on CPU tensors (the tests); there the SiLU takes Triton's
``exp`` (the interpreter has no libdevice), a few ulp off torch's CPU one in fp32.
"""

import functools
import os

import torch

import triton
import triton.language as tl

try:  # CUDA's libm: the exp torch's SiLU takes
    from triton.language.extra import libdevice
except ImportError:  # older Triton
    libdevice = None

SILU_BLOCK = 1024  # columns per silu_mul program
# Compiled, the SiLU takes libdevice's exp (see the module note); the interpreter has no libdevice.
_EXACT = libdevice is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


@triton.jit
def _add_rms_norm_kernel(X, R, W, Y, H, N, s_x, s_r, s_y, s_h, eps, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * s_x + cols, mask=mask, other=0.0)
    if RESIDUAL:  # h = x + residual, rounded to the activation dtype as torch's add does
        r = tl.load(R + row * s_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + row * s_h + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * inv).to(X.dtype.element_ty)  # cast back, then the weight: the model's RMSNorm order
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(Y + row * s_y + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_head(X, W, COS, SIN, OUT, t, h, s_t, s_h, s_c, s_ot, s_oh, eps, HALF, NORM: tl.constexpr,
                 STORE: tl.constexpr, BLOCK: tl.constexpr):
    """One head of one token, in place: ``x * cos + cat(-x2, x1) * sin`` (each product and the sum
    rounded to the dtype, as in torch), after ``w * rms_norm(x)`` with ``NORM``; with ``STORE`` also
    into ``OUT`` (the cache slot's row ``t``)."""
    i = tl.arange(0, BLOCK)
    m = i < HALF
    dt = X.dtype.element_ty
    base = X + t * s_t + h * s_h
    x1 = tl.load(base + i, mask=m, other=0.0)
    x2 = tl.load(base + HALF + i, mask=m, other=0.0)
    if NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF) + eps)
        w1 = tl.load(W + i, mask=m, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + i, mask=m, other=0.0).to(tl.float32)
        x1 = (w1 * (f1 * inv).to(dt).to(tl.float32)).to(dt)
        x2 = (w2 * (f2 * inv).to(dt).to(tl.float32)).to(dt)
    c1 = tl.load(COS + t * s_c + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t * s_c + HALF + i, mask=m, other=0.0).to(tl.float32)
    n1 = tl.load(SIN + t * s_c + i, mask=m, other=0.0).to(tl.float32)
    n2 = tl.load(SIN + t * s_c + HALF + i, mask=m, other=0.0).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * n1).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * n2).to(dt).to(tl.float32)).to(dt)
    tl.store(base + i, o1, mask=m)
    tl.store(base + HALF + i, o2, mask=m)
    if STORE:
        out = OUT + t * s_ot + h * s_oh
        tl.store(out + i, o1, mask=m)
        tl.store(out + HALF + i, o2, mask=m)


@triton.jit
def _rotary_kernel(Q, K, V, WQ, WK, COS, SIN, KC, VC, SLOTS, HQ, HK, HALF, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_c,
                   s_kcs, s_kch, s_vcs, s_vch, eps, NORM: tl.constexpr, STORE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64) if STORE else t
    if h < HQ:
        _rotate_head(Q, WQ, COS, SIN, Q, t, h, s_qt, s_qh, s_c, 0, 0, eps, HALF, NORM, False, BLOCK)
    elif h < HQ + HK:
        _rotate_head(K, WK, COS, SIN, KC + slot * s_kcs, t, h - HQ, s_kt, s_kh, s_c, 0, s_kch, eps, HALF, NORM, STORE,
                     BLOCK)
    else:  # STORE: the value head, copied to the cache as it is
        i = tl.arange(0, 2 * BLOCK)
        m = i < 2 * HALF
        x = tl.load(V + t * s_vt + (h - HQ - HK) * s_vh + i, mask=m)
        tl.store(VC + slot * s_vcs + (h - HQ - HK) * s_vch + i, x, mask=m)


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    """``exp`` as CUDA's ``expf`` computes it (torch's SiLU), or Triton's where libdevice is missing (the
    interpreter)."""
    if EXACT:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _silu_mul_kernel(G, U, O, N, s_g, s_u, s_o, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * s_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * s_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.math.div_rn(g, 1.0 + _exp(-g, EXACT)).to(G.dtype.element_ty)  # F.silu in the gate's dtype, then the product
    tl.store(O + row * s_o + cols, (s.to(tl.float32) * u).to(O.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_backward_kernel(G, U, DH, DG, DU, N, s_g, s_u, s_dh, s_dg, s_du, EXACT: tl.constexpr,
                              BLOCK: tl.constexpr):
    """The gradients of ``h = silu(g) * u`` as autograd computes them from torch's two ops:
    ``du = dh * silu(g)`` and ``ds = dh * u`` (each rounded to the dtype), then SiLU's backward of ``ds``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * s_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * s_u + cols, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(DH + row * s_dh + cols, mask=mask, other=0.0).to(tl.float32)
    e = 1.0 + _exp(-g, EXACT)
    s = tl.math.div_rn(g, e).to(G.dtype.element_ty).to(tl.float32)
    tl.store(DU + row * s_du + cols, (dh * s).to(DU.dtype.element_ty), mask=mask)
    ds = (dh * u).to(G.dtype.element_ty).to(tl.float32)
    sig = tl.math.div_rn(1.0, e)
    tl.store(DG + row * s_dg + cols, (ds * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as 2-D rows over its last dim, unit-strided within a row (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@functools.cache
def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(h, weight * (h * rsqrt(mean(h^2) + eps)).to(h.dtype))`` over the last dim, with ``h = x +
    residual`` (``None`` without a residual: then the norm of ``x``)."""
    x2 = _rows(x)
    N = x2.shape[1]
    y = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    h = r2 = None
    if residual is not None:
        r2 = _rows(residual)
        h = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    if x2.shape[0]:
        block = triton.next_power_of_2(N)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, r2 if r2 is not None else x2, weight.contiguous(), y, h if h is not None else y, N, x2.stride(0),
            r2.stride(0) if r2 is not None else 0, y.stride(0), h.stride(0) if h is not None else 0, float(eps),
            RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block))
    shape = (*x.shape[:-1], N)
    return (h.view(shape) if h is not None else None), y.view(shape)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
            store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rotate ``q [..., Hq, D]`` and ``k [..., Hk, D]`` in place by ``cos``/``sin [..., D]`` (one row
    per token; the half-split layout over the whole head), after the per-head RMSNorm of weights
    ``q_weight``/``k_weight [D]`` (both or neither). Every token's heads must be laid out at one
    stride (a projection's output viewed as heads is). ``store``: ``(v [..., Hk, D], k_cache,
    v_cache [blocks, block_size, Hk, D], slots [tokens])``: each token's rotated key and its value
    written to its cache slot as well (the paged KV cache's write, in the same kernel)."""
    D = q.shape[-1]
    HQ, HK = q.shape[-2], k.shape[-2]
    q3, k3 = q.view(-1, HQ, D), k.view(-1, HK, D)
    c2, s2 = cos.reshape(-1, D), sin.reshape(-1, D)
    if c2.stride() != s2.stride() or c2.stride(-1) != 1:
        c2, s2 = c2.contiguous(), s2.contiguous()
    T = q3.shape[0]
    if not T:
        return
    norm = q_weight is not None
    if store is not None:
        v, k_cache, v_cache, slots = store
        v3, kc, vc = v.view(-1, HK, D), k_cache.view(-1, HK, D), v_cache.view(-1, HK, D)
        extra = (v3, kc, vc, slots, v3.stride(0), v3.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1))
    else:
        extra = (k3, k3, k3, c2, 0, 0, 0, 0, 0, 0)
    v3, kc, vc, slots, s_vt, s_vh, s_kcs, s_kch, s_vcs, s_vch = extra
    block = triton.next_power_of_2(D // 2)
    _rotary_kernel[(T, HQ + HK * (2 if store is not None else 1))](
        q3, k3, v3, q_weight if norm else c2, k_weight if norm else c2, c2, s2, kc, vc, slots, HQ, HK, D // 2,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), s_vt, s_vh, c2.stride(0), s_kcs, s_kch, s_vcs, s_vch,
        float(eps), NORM=norm, STORE=store is not None, BLOCK=block, num_warps=1 if block <= 64 else 2,
        enable_fp_fusion=False)  # no fused multiply-add: each product is rounded before the sum, as in torch


def _gate_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """SwiGLU's operands as 2-D rows; where all are contiguous and a row holds several of a program's
    blocks, as rows of one block each, so that programs launched one after another read memory
    one after another (not one block of every row first)."""
    rows = [_rows(t) for t in tensors]
    N = rows[0].shape[1]
    if N > SILU_BLOCK and N % SILU_BLOCK == 0 and all(r.is_contiguous() for r in rows):
        return [r.view(-1, SILU_BLOCK) for r in rows]
    return rows


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``."""
    g2, u2 = _gate_rows(gate, up)
    M, N = g2.shape
    out = torch.empty((M, N), device=gate.device, dtype=torch.promote_types(gate.dtype, up.dtype))
    if M:
        _silu_mul_kernel[(M, triton.cdiv(N, SILU_BLOCK))](g2, u2, out, N, g2.stride(0), u2.stride(0), out.stride(0),
                                                         EXACT=_EXACT, BLOCK=SILU_BLOCK, num_warps=4)
    return out.view(*gate.shape[:-1], gate.shape[-1])


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`silu_mul` (``gate`` and ``up`` of one dtype) for ``grad``, the output's:
    ``(d gate, d up)``, shaped like ``gate``."""
    g2, u2, d2 = _gate_rows(gate, up, grad)
    M, N = g2.shape
    dg = torch.empty((M, N), device=gate.device, dtype=gate.dtype)
    du = torch.empty((M, N), device=gate.device, dtype=up.dtype)
    if M:
        _silu_mul_backward_kernel[(M, triton.cdiv(N, SILU_BLOCK))](
            g2, u2, d2, dg, du, N, g2.stride(0), u2.stride(0), d2.stride(0), dg.stride(0), du.stride(0),
            EXACT=_EXACT, BLOCK=SILU_BLOCK, num_warps=4,
            enable_fp_fusion=True)  # 1 + g * (1 - sig) as one fused multiply-add, as nvcc compiles torch's
    return dg.view(gate.shape), du.view(gate.shape)
