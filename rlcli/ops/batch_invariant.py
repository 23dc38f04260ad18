"""Batch-invariant numerics: a token's numbers do not depend on what else is in its batch.

The engine computes a token in a step shared with other sequences (one row per decoding
sequence, a chunk of a prompt), the trainer in one packed forward of whole sequences. The
same math then rounds differently, because the kernels pick their summation order by shape:

* **GEMMs.** The CPU GEMM libraries pick kernels and thread splits by shape. MKL's fp32
  sgemm on AVX2 takes other kernels below 12 rows; on AVX-512 with two threads it gives a
  row other bits at every row count once K reaches about 1024 (it splits the reduction
  across the threads), and oneDNN's bf16 GEMMs change kernels from about 33 rows. What does
  hold on both: a GEMM of one fixed shape, at one thread count, computes each of its rows the
  same way whichever row of the block it is and whatever the other rows hold. So under the
  flag every linear (:func:`pad_linear_rows`, :func:`rows_mm`) runs as GEMMs of exactly
  :data:`ROW_BLOCK` rows (zero rows appended to the last block, their outputs dropped), and
  the engine and the trainer both run on one intra-op thread, set once at their start
  (:func:`pin_threads`; adaptive threads are off under the flag): two thread counts would
  split the reduction differently. The tests check this on the machine they run on. It is
  slow: the weight is packed once per block and one core works (``bench/batch_invariant_speed.py``).
  The backward of a plain linear needs no invariance and runs as whole-matrix GEMMs
  (:class:`_BlockedLinearFn`); FP8 linears keep their own backward.
  FP8 linears quantize per row (1x128 tiles) before their GEMM, so blocking leaves each
  row's quantization alone.
* **Attention.** SDPA's CPU kernels block queries and keys by sizes that depend on the
  sequence lengths, and the engine's decode pads each sequence to a bucket, so the softmax
  sums run in other orders. :func:`invariant_attention` computes each query from its own
  keys in fixed blocks of :data:`KEY_BLOCK` keys (block ``j`` holds positions ``32j..32j+31`` of
  the sequence): scores as an elementwise product summed over the head dim, one max (exact in
  any order), ``exp``, sums inside a block as one fixed-length reduction, then the blocks
  added one after the other from position 0. A key a query does not see contributes an exact
  zero, so a query gives the same bits in a ``[T, T]`` causal forward, in a prefill chunk
  after cached keys and in a decode step next to other sequences.
* **Logprobs.** The engine's sampler reports ``log_softmax``, the trainer computes
  ``z[t] - logsumexp(z)`` per chunk; under the flag the engine reports the trainer's formula
  (:func:`rlcli.ops.logprobs.token_logprobs_of`).

Elementwise work (RMSNorm, rotary tables, SwiGLU, residual adds, casts) and row reductions of
a fixed length (RMSNorm's mean, the softmax sums over the vocabulary) already give every row
the same code on the CPU. Two caveats: torch's elementwise CPU loops run two vectors at a time
and a scalar loop over what is left, and fp32 SiLU/sigmoid round differently in the two, so a
row's bits can follow where it falls in the tensor unless its width is a multiple of two vectors
(32 fp32 values on AVX-512: every recipe model's widths are; 16-wide MoE experts under expert
parallelism gave one-ulp differences, ``tests/parallel/dist_ep_cp.py``); and ``torch.compile``
fuses and reorders, so the flag refuses ``train.compile``.

Known exception, not understood: on this session's AVX-512 VM (torch 2.13) the first ``exp``
of :func:`invariant_attention` in a test process, after other tests had run, gave other bits
(up to 1e-4 apart) about one time in five; the same call again gave the usual ones.

**On CUDA** the GEMM, attention and reduction kernels choose tiles and split-K by shape, and
torch's row reductions split a row across threads when there are few rows, so the flag runs
kernels of its own there (:mod:`rlcli.ops.invariant_kernels`, Triton): every linear's forward
(``mm``; FP8 linears' forward GEMM ``fp8_mm``, their quantization being per row already),
attention (one varlen kernel that reads the engine's paged cache and the trainer's packed rows
in place: :meth:`rlcli.ops.attention.PagedAttention._invariant_kernel`,
:class:`rlcli.ops.document_attention._InvariantKernelFn`; :func:`invariant_attention` takes the
same kernel), RMSNorm (:func:`make_batch_invariant` swaps them in) and, after :func:`enable`
(the engine and the trainer call it at start), the LM head of
:func:`rlcli.ops.logprobs.chunked_logprobs` (:func:`rows_mm`) and its softmax sum
(:func:`row_sum`). Their backward passes are torch's (cuBLAS; flash varlen or SDPA for
attention; autograd through RMSNorm's formula): a gradient need not be batch-invariant. Elementwise CUDA kernels compute an element from its own inputs whatever the
tensor's size. The engine's sampler keeps its own ops (which token is drawn may differ; the
logprob it reports is the trainer's). Top-p's nucleus sorts stably (ties in token order) and takes
its cumulative sum by the ``row_cumsum`` kernel and its logsumexp by :func:`row_sum`
(:func:`rlcli.ops.sampling.top_p_keep`, :func:`row_logsumexp`).

**MoE.** The router's linear runs on blocked rows (CPU) or by the ``mm`` kernel (CUDA,
:class:`rlcli.ops.invariant_layers._InvariantRouter`); the top-k gates are normalized by :func:`row_sum`. The experts: on the
CPU every expert's GEMMs run on that expert's rows alone, blocked (the grouped GEMM's per-expert row
counts follow the batch); on CUDA one ``grouped_mm`` / ``fp8_grouped_mm`` kernel launch per
projection computes each token's row on its expert's weight alone (:class:`rlcli.ops.invariant_layers._InvariantExperts`).
A token's ``k`` weighted expert outputs are added in slot order, one rounded add at a time (the
plain layer's batched product picks its kernel by the token count;
:class:`rlcli.ops.invariant_layers._InvariantMoE`). Gates, the top-k and the weighting are row-wise.

**MLA** (DeepSeek-V3 / Kimi-K2; :class:`rlcli.ops.invariant_layers._InvariantMLA`). The engine attends in latent form
(``kv_b_proj`` absorbed into the query and output sides, one 576-wide K/V head for DeepSeek-V3) and
the trainer, by default, in expanded form: the same function, other roundings. Under the flag the
trainer takes the latent form too; the absorbed projections run per head on invariant rows
(:func:`rlcli.ops.invariant_layers.head_linear`), the latent attention through the GQA path's invariant attention with one K/V
head whose value is the latent (:meth:`rlcli.ops.attention.PagedAttention.attend`), and an FP8
``kv_b_proj`` on a master weight is absorbed quantized and dequantized, as the FP8 engine holds it.

**DSA** (DeepSeek-V3.2, GLM-5: MLA whose queries attend to an indexer's top-k tokens; both sides
attend in latent form anyway). The indexer's linears are linears like any other and its LayerNorm
a fixed-length row reduction. Its scores (:func:`rlcli.ops.mla.index_scores`) come from the fused
Triton kernel on CUDA, which computes each score from its own query and key, and on the CPU from
each head's products summed over the head dim and the heads added in order. The top-k
(:func:`rlcli.ops.mla.select_topk`) already chose alike (ties to the earlier token); under the flag
it also lists the chosen tokens first, so a query's tokens sit in the same slots whether its window
starts the row (the engine) or follows other documents (the trainer), and whatever ``k`` (the
shorter of top-k and the keys the call holds). The sparse attention then adds the chosen tokens in
fixed blocks from slot 0, padding adding exact zeros: the Triton kernel on CUDA (the engine reads
the chosen tokens from its cache by slot), :func:`rlcli.ops.mla.invariant_sparse_attention` on the
CPU. On CUDA, widths the DSA kernels do not take are refused.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from rlcli.errors import ConfigError

KEY_BLOCK = 32
"""Keys per block of :func:`invariant_attention`'s fixed summation order."""


# ------------------------------------------------------------------------------ GEMM rows

ROW_BLOCK = 16
"""Rows of every GEMM under batch-invariant numerics (see module docstring)."""


def invariant_rows(m: int) -> int:
    """The row count ``m`` rows are padded to: a whole number of :data:`ROW_BLOCK` blocks."""
    return max(1, -(-m // ROW_BLOCK)) * ROW_BLOCK


def pad_rows(x_MK: torch.Tensor) -> torch.Tensor:
    """``x`` with zero rows appended up to :func:`invariant_rows` (unchanged when it has enough)."""
    pad = invariant_rows(x_MK.shape[0]) - x_MK.shape[0]
    return F.pad(x_MK, (0, 0) * (x_MK.dim() - 1) + (0, pad)) if pad else x_MK


def pin_threads() -> None:
    """Run this process on one intra-op thread from now on (the engine and the trainer call it
    at start under the flag). Set once, not around each GEMM: torch's thread count is the
    process's, so changing it per call would also change it under the process's other threads."""
    torch.set_num_threads(1)


def blocked_rows(fn, x_MK: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (a linear), computed as ``fn`` of :data:`ROW_BLOCK`-row
    blocks, so that a row's result does not depend on how many rows came with it."""
    m = x_MK.shape[0]
    x_MK = pad_rows(x_MK)
    return torch.cat([fn(x_MK[i:i + ROW_BLOCK]) for i in range(0, x_MK.shape[0], ROW_BLOCK)])[:m]


# ------------------------------------------------------------------------------ CUDA kernels

_STATE = {"enabled": False}
_KERNELS_ON_CPU = os.environ.get("RLCLI_INVARIANT_KERNELS_ON_CPU") == "1"  # tests, under TRITON_INTERPRET=1


def enable(on: bool = True) -> None:
    """Process-wide: :func:`rows_mm` and :func:`row_sum` take the invariant kernels on CUDA (the
    engine and the trainer call it at start under ``model.batch_invariant``; modules swapped by
    :func:`make_batch_invariant` need no call)."""
    _STATE["enabled"] = bool(on)


def batch_invariant_setup(device: torch.device) -> None:
    """Process setup under ``model.batch_invariant`` (the engine and the trainer call it at start):
    on the CPU one intra-op thread (:func:`pin_threads`); on CUDA the kernels must import; then
    :func:`enable`. Raises ConfigError naming what to change."""
    if device.type == "cpu":
        pin_threads()  # both sides' thread count
    elif device.type == "cuda":
        if not kernels_available():
            raise ConfigError("model.batch_invariant on CUDA runs Triton kernels, and triton does not import "
                              "here: install triton or set model.batch_invariant = false")
    else:
        raise ConfigError(f"model.batch_invariant runs on the CPU and CUDA, not {device.type}: "
                          "set model.batch_invariant = false")
    enable()


def kernels_available() -> bool:
    """Whether :mod:`rlcli.ops.invariant_kernels` imports (Triton)."""
    return invariant_kernels() is not None


def invariant_kernels():
    """The :mod:`rlcli.ops.invariant_kernels` module, or None where Triton does not import."""
    try:
        from rlcli.ops import invariant_kernels as kernels
    except (ImportError, OSError):
        return None
    return kernels


def on_kernels(x: torch.Tensor) -> bool:
    """Whether ``x`` is computed by the invariant kernels (CUDA; CPU tensors only in the kernel tests)."""
    return x.is_cuda or (_KERNELS_ON_CPU and x.device.type == "cpu")


def rows_mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """``a @ b``: in :func:`blocked_rows` on the CPU, by the invariant ``mm`` kernel on CUDA
    after :func:`enable` (see module docstring)."""
    if _STATE["enabled"] and on_kernels(a_MK):
        return invariant_kernels().mm(a_MK, b_KN.T)
    if a_MK.device.type != "cpu":
        return a_MK @ b_KN
    return blocked_rows(lambda block: block @ b_KN, a_MK)


def row_cumsum(x_MN: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(-1)`` of a 2-D tensor, by the invariant ``row_cumsum`` kernel on CUDA after
    :func:`enable` (fp32 out; torch's CUDA cumsum scans a lone row by another algorithm than many
    rows; its CPU cumsum runs each row in order)."""
    if _STATE["enabled"] and on_kernels(x_MN):
        return invariant_kernels().row_cumsum(x_MN)
    return x_MN.cumsum(dim=-1)


def row_logsumexp(x_MN: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(x, -1)`` of a 2-D tensor whose rows each hold a finite value; on CUDA
    after :func:`enable` its sum is :func:`row_sum`'s."""
    if _STATE["enabled"] and on_kernels(x_MN):
        m = x_MN.amax(dim=-1, keepdim=True)
        return m[:, 0] + row_sum((x_MN - m).exp()).log()
    return torch.logsumexp(x_MN, dim=-1)


def row_sum(x_MN: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1)`` of a 2-D tensor, by the invariant ``row_sum`` kernel on CUDA after :func:`enable`
    (fp32 out; torch's CPU row reductions are already row-invariant)."""
    if _STATE["enabled"] and on_kernels(x_MN):
        return invariant_kernels().row_sum(x_MN)
    return x_MN.sum(dim=-1)


class _KernelRMSNormFn(torch.autograd.Function):
    """The model's RMSNorm (:class:`rlcli.models.layers.RMSNorm`) by the ``rms_norm`` kernel;
    backward by autograd through the model's formula (:func:`rlcli.models.layers.rms_norm`), recomputed."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return invariant_kernels().rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        from rlcli.models.layers import rms_norm

        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
            dx, dw = torch.autograd.grad(rms_norm(xd, wd, ctx.eps), (xd, wd), dy)
        return dx, dw, None


class _KernelNorm:
    """Mixin in front of an RMSNorm's class: the ``rms_norm`` kernel on CUDA (see module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if on_kernels(x):
            return _KernelRMSNormFn.apply(x, self.weight, self.eps)
        return super().forward(x)


class KernelGemm:
    """An FP8 GEMM backend (:mod:`rlcli.ops.fp8.backends`) whose ``gemm`` (forward and input
    gradient) runs the invariant ``fp8_mm`` kernel on CUDA; everything else is the wrapped one's."""

    fused_rows = False  # decode rows too go through the quantization and the invariant gemm
    row_align = 1  # its kernel takes any rows (not inner's padding)

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = f"invariant+{inner.name}"

    def gemm(self, a, sa, b, sb, out_dtype):
        if on_kernels(a):
            return invariant_kernels().fp8_mm(a, sa, b, sb, out_dtype)
        return self.inner.gemm(a, sa, b, sb, out_dtype)

    def grouped_gemm(self, a, sa, b, sb, offs, out_dtype):
        if on_kernels(a):
            return invariant_kernels().fp8_grouped_mm(a, sa, b, sb, offs, out_dtype)
        return self.inner.grouped_gemm(a, sa, b, sb, offs, out_dtype)

    def grouped_gemm_x(self, x, ue8m0, b, sb, offs, out_dtype):
        if on_kernels(x):  # the shared quantization of x, then grouped_gemm above
            from rlcli.ops.fp8.backends import grouped_gemm_x

            return grouped_gemm_x(self, x, ue8m0, b, sb, offs, out_dtype)
        return self.inner.grouped_gemm_x(x, ue8m0, b, sb, offs, out_dtype)

    def gemm_x(self, x, ue8m0, b, sb, out_dtype):
        from rlcli.ops.fp8.backends import gemm_x

        return gemm_x(self, x, ue8m0, b, sb, out_dtype)

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy, unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.inner, name)


class _BlockedLinearFn(torch.autograd.Function):
    """``F.linear`` whose forward runs in :func:`blocked_rows` and whose backward is two
    whole-matrix GEMMs: only the forward's numbers must not depend on the batch (they make the
    logprobs); blocked by autograd, the weight gradient was a sum of one 16-row product per block."""

    @staticmethod
    def forward(ctx, x_MK, weight_NK, bias_N):
        ctx.save_for_backward(x_MK, weight_NK)
        ctx.has_bias = bias_N is not None
        return blocked_rows(lambda block: F.linear(block, weight_NK, bias_N), x_MK)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, weight_NK = ctx.saved_tensors
        dx = dy_MN @ weight_NK if ctx.needs_input_grad[0] else None
        dw = dy_MN.t() @ x_MK if ctx.needs_input_grad[1] else None
        db = dy_MN.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


class _KernelLinearFn(_BlockedLinearFn):
    """``F.linear`` whose forward is the invariant ``mm`` kernel (CUDA); backward as
    :class:`_BlockedLinearFn`'s (torch's GEMMs)."""

    @staticmethod
    def forward(ctx, x_MK, weight_NK, bias_N):
        ctx.save_for_backward(x_MK, weight_NK)
        ctx.has_bias = bias_N is not None
        y = invariant_kernels().mm(x_MK, weight_NK)
        return y if bias_N is None else y + bias_N.to(y.dtype)


class _RowPadded:
    """Mixin in front of a linear's class: on the CPU its forward runs in :func:`blocked_rows`
    (a plain ``nn.Linear`` through :class:`_BlockedLinearFn`, FP8 linears by their own autograd)."""

    plain_linear = False  # the class's forward is nn.Linear's (set by pad_linear_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = on_kernels(x)
        if (kernels and not self.plain_linear) or (not kernels and x.device.type != "cpu"):
            return super().forward(x)  # FP8 linears: their backend is a KernelGemm (make_batch_invariant)
        rows = x.numel() // max(x.shape[-1], 1)
        x_MK = x.reshape(rows, x.shape[-1])
        if kernels:
            out = _KernelLinearFn.apply(x_MK, self.weight, self.bias)
        elif self.plain_linear:
            out = _BlockedLinearFn.apply(x_MK, self.weight, self.bias)
        else:
            out = blocked_rows(super().forward, x_MK)
        return out.view(*x.shape[:-1], out.shape[-1])


_SWAPPED: dict[type, type] = {}  # original class -> its subclass with a batch-invariant mixin in front


def pad_linear_rows(model: nn.Module) -> int:
    """Make every ``nn.Linear`` of ``model`` (FP8 linears and the LM head included) run in
    :func:`blocked_rows` on the CPU, by swapping in a subclass (same parameters, same
    state dict; after ``convert_to_fp8``); returns how many it swapped. Idempotent."""
    count = 0
    for module in model.modules():
        cls = type(module)
        if isinstance(module, nn.Linear) and not issubclass(cls, _RowPadded):
            if cls not in _SWAPPED:
                _SWAPPED[cls] = type(f"RowPadded{cls.__name__}", (_RowPadded, cls),
                                    {"plain_linear": cls.forward is nn.Linear.forward})
            module.__class__ = _SWAPPED[cls]
            count += 1
    return count


def _on_cuda(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.is_cuda


def _check_dsa_kernels(attn: nn.Module) -> None:
    """On CUDA the flag runs DSA (indexer scores, sparse attention) on :mod:`rlcli.ops.dsa_triton`'s
    kernels in the trainer and the engine alike; widths they do not take are refused."""
    from rlcli.ops import dsa_triton

    index_dim = attn.indexer.head_dim if attn.indexer is not None else 0
    if not (dsa_triton.attention_supported(attn.kv_lora_rank, attn.rope_dim)
            and (not index_dim or dsa_triton.scores_supported(index_dim))):
        raise ConfigError("model.batch_invariant runs DSA on CUDA through its Triton kernels, which take a latent "
                          "of at most 512 values, a rope key of at most 128 and indexer heads of at most 256; this "
                          f"model's are {attn.kv_lora_rank}, {attn.rope_dim} and {index_dim}: "
                          "set model.batch_invariant = false")


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Everything ``model.batch_invariant`` swaps into a model, in place (after ``convert_to_fp8``;
    idempotent): :func:`pad_linear_rows`; RMSNorms that run the ``rms_norm`` kernel on CUDA; MoE
    routers and experts on blocked rows (CPU); FP8
    linears' GEMM backends wrapped in :class:`KernelGemm` (one wrapper per backend, so that
    stacked siblings still share theirs)."""
    from rlcli.models.layers import RMSNorm
    from rlcli.models.deepseek_v3 import MLAttention
    from rlcli.models.layers import Attention
    from rlcli.models.moe import MoE, GroupedExperts, Router
    from rlcli.ops.invariant_layers import _InvariantExperts, _InvariantMLA, _InvariantMoE, _InvariantRouter

    cuda = _on_cuda(model)
    for layer in getattr(getattr(model, "model", None), "layers", ()):
        attn = layer.self_attn
        if not isinstance(attn, (Attention, MLAttention)):
            raise ConfigError("model.batch_invariant covers grouped-query and MLA attention (dense or DSA); this "
                              f"model's is {type(attn).__name__}: set model.batch_invariant = false")
        if cuda and getattr(attn, "sparse", False):
            _check_dsa_kernels(attn)
    pad_linear_rows(model)
    wrapped: dict[int, KernelGemm] = {}
    for module in model.modules():
        for base, mixin in ((RMSNorm, _KernelNorm), (Router, _InvariantRouter), (GroupedExperts, _InvariantExperts),
                            (MoE, _InvariantMoE), (MLAttention, _InvariantMLA)):
            if isinstance(module, base) and not isinstance(module, mixin):
                cls = type(module)
                if cls not in _SWAPPED:
                    _SWAPPED[cls] = type(f"Invariant{cls.__name__}", (mixin, cls), {})
                module.__class__ = _SWAPPED[cls]
        backend = getattr(module, "backend", None)  # FP8 linears and FP8 experts
        if backend is not None and not isinstance(backend, KernelGemm):
            module.backend = wrapped.setdefault(id(backend), KernelGemm(backend))
    return model


# ------------------------------------------------------------------------------ attention


def invariant_attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, scale: float,
                        lens_B: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention in a fixed summation order, ``[B, Hq, T, Dv]`` in ``q``'s dtype.

    Row ``b`` holds ``n_b`` keys (``lens_B``, default all ``S``; keys past ``n_b`` are padding,
    which must be finite: the engine's decode reads the sequence's own first key there); its
    ``T`` queries are the last ``T`` of them, so query ``j`` sees keys ``0 .. n_b - T + j``
    (bottom-right causal). GQA: query head ``h`` reads key head ``h // (Hq / Hkv)``. Computed
    in fp32; each query's output depends only on its own query, keys and values (module
    docstring), so queries may also be computed in chunks (long rows are, to bound memory).
    Differentiable. On CUDA the ``attention`` kernel computes the forward (same order, its own
    bits) and SDPA the backward.
    """
    B, Hq, T, D = q_BHTD.shape
    S, Dv = k_BHSD.shape[2], v_BHSD.shape[-1]
    lens = torch.full((B,), S, device=q_BHTD.device) if lens_B is None else lens_B.to(q_BHTD.device)
    if on_kernels(q_BHTD):
        return _KernelAttentionFn.apply(q_BHTD, k_BHSD, v_BHSD, float(scale), lens)
    per_query = Hq * S * (max(D, Dv) + 1)
    chunk = max(1, _MAX_ELEMENTS // max(per_query * B, 1))
    if T <= chunk:
        return _attend(q_BHTD, k_BHSD, v_BHSD, scale, lens)
    outs = []
    for s in range(0, T, chunk):  # queries s..e-1 are the last e - s of n_b - (T - e) keys
        e = min(T, s + chunk)
        n = lens - (T - e)
        width = int(n.max())
        outs.append(_attend(q_BHTD[:, :, s:e], k_BHSD[:, :, :width], v_BHSD[:, :, :width], scale, n))
    return torch.cat(outs, dim=2)


_MAX_ELEMENTS = 1 << 24  # largest temporary of one _attend call (64 MiB of fp32)


def _attend(q_BHTD, k_BHSD, v_BHSD, scale: float, lens_B: torch.Tensor) -> torch.Tensor:
    B, Hq, T, D = q_BHTD.shape
    Hkv, S, Dv = k_BHSD.shape[1], k_BHSD.shape[2], v_BHSD.shape[-1]
    G, nb = Hq // Hkv, max(1, -(-S // KEY_BLOCK))
    dev, pad = q_BHTD.device, nb * KEY_BLOCK - S
    pos = torch.arange(nb * KEY_BLOCK, device=dev)
    # V gets a column of ones: its sums are the softmax denominators, in the same loop.
    kv = torch.cat([k_BHSD.float(), v_BHSD.float(), torch.ones_like(v_BHSD[..., :1], dtype=torch.float32)], -1)
    if pad:
        kv = F.pad(kv, (0, 0, 0, pad))
    k, v = kv.split([D, Dv + 1], dim=-1)
    last_BT = lens_B[:, None] - T + torch.arange(T, device=dev)[None]  # the last key each query sees
    # -inf on the keys a query does not see (added: cheaper than a broadcast masked_fill); their
    # exp is an exact 0, and 0 times a finite value adds nothing to a block's sum.
    bias = torch.zeros(B, 1, 1, T, nb * KEY_BLOCK, device=dev).masked_fill_(
        (pos[None, None, :] > last_BT[:, :, None])[:, None, None], float("-inf"))
    q = q_BHTD.float().view(B, Hkv, G, T, 1, D)
    s = (q * k[:, :, None, None]).sum(-1).mul_(scale).add_(bias)  # [B, Hkv, G, T, S']
    e = (s - s.amax(-1, keepdim=True)).exp_().view(B, Hkv, G, T, nb, 1, KEY_BLOCK)
    vt = v.reshape(B, Hkv, 1, 1, nb, KEY_BLOCK, Dv + 1).transpose(-1, -2)  # [B, Hkv, 1, 1, nb, Dv + 1, KEY_BLOCK]
    parts = (e * vt).sum(-1)  # [B, Hkv, G, T, nb, Dv + 1]: one fixed-length sum per block
    acc = parts[..., 0, :]
    for j in range(1, nb):  # block by block from position 0: unseen blocks add exact zeros
        acc = acc + parts[..., j, :]
    return (acc[..., :Dv] / acc[..., Dv:]).view(B, Hq, T, Dv).to(q_BHTD.dtype)


class _KernelAttentionFn(torch.autograd.Function):
    """:func:`invariant_attention` by the ``attention`` kernel; backward through SDPA with the
    same mask (the gradient need not be batch-invariant)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, lens):
        ctx.save_for_backward(q, k, v, lens)
        ctx.scale = scale
        return invariant_kernels().dense_attention(q, k, v, scale, lens)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lens = ctx.saved_tensors
        T, S = q.shape[2], k.shape[2]
        last = lens[:, None] - T + torch.arange(T, device=q.device)[None]  # [B, T]: the last key each query sees
        mask = torch.arange(S, device=q.device)[None, None] <= last[:, :, None]  # [B, T, S]
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask[:, None], scale=ctx.scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), dout)
        return dq, dk, dv, None, None
