"""Which quantizer runs, and how often: Triton kernels on CUDA, weights once per optimizer step.

Quantizers. On CUDA with triton importable, the one-pass kernels of :mod:`kernels` run; the
torch reference of :mod:`quant` runs everywhere else. Both give bit-identical data and
scales (``tests/ops/test_fp8_kernels.py``), so the choice changes speed only. ``IMPL``
forces one (tests run the Triton path on CPU tensors under ``TRITON_INTERPRET=1``). With
``auto``, a Triton kernel that fails to compile or launch is logged once and the torch path
takes over.

Weights. :class:`WeightCache` holds a weight's 128x128 quantization and its transpose (the
dgrad operand) and serves every forward, backward and microbatch until the weight changes.
A change is seen two ways: the tensor's version counter (in-place loads, ``copy_``, foreach
optimizers) and a global optimizer-step counter bumped by a hook on every
``torch.optim.Optimizer.step``: fused optimizers (``AdamW(fused=True)``) update parameters
without bumping their version, so the version alone would serve a stale weight. A weight
updated outside a torch optimizer through ``.data`` (which has its own version counter)
is not seen; call :func:`invalidate_weights` after such an update. Under FSDP2 the cache
holds the quantization of the gathered (unsharded) weight; the backward pass reuses it
although FSDP re-gathers the weight (see :meth:`WeightCache.get`), so each weight is
quantized once per step, at the cost of holding FP8 copies of the unsharded weights
(2 bytes per parameter with the transpose) between steps (tests/ops/test_fp8_fsdp.py).

Activations. q/k/v (and gate/up) projections read the same input tensor; the last input's
quantization is kept (a weak reference to the tensor plus its version) so the three
linears quantize it once.
"""

import logging
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from rlcli.ops.fp8 import kernels, quant
from rlcli.ops.fp8.quant import transpose_blocks

log = logging.getLogger("rlcli.fp8")
IMPL = {"name": "auto"}  # "auto": Triton on CUDA when it imports; "torch" / "triton" force one
_STEP = [0]


def _bump_step(optimizer, args, kwargs) -> None:
    _STEP[0] += 1


register_optimizer_step_post_hook(_bump_step)


def invalidate_weights() -> None:
    """Drop every cached FP8 weight (after updating weights outside a torch optimizer)."""
    _STEP[0] += 1


def use_triton(t: torch.Tensor) -> bool:
    name = IMPL["name"]
    if name == "auto":
        return t.is_cuda and kernels.available()
    return name == "triton"


def _triton_failed(e: Exception) -> None:
    """A Triton kernel that does not compile or launch here: with ``auto``, fall back to torch for good."""
    if IMPL["name"] != "auto":
        raise e
    log.warning("fp8: Triton quantization failed (%s: %s); using the torch reference from now on",
                type(e).__name__, str(e)[:500])
    IMPL["name"], IMPL["failed"] = "torch", f"{type(e).__name__}: {str(e)[:200]}"


def quantize_act(x_MK: torch.Tensor, ue8m0: bool, rows: bool = True, cols: bool = False, rows_to: int = 0):
    """1x128 tiles of ``x`` along K (``rows``) and of ``x^T`` along M (``cols``); both -> a pair of pairs.
    ``rows_to`` (rows only): zero rows appended up to that many, in the same pass."""
    if use_triton(x_MK):
        try:
            return kernels.quantize_act(x_MK, ue8m0, rows, cols, rows_out=rows_to)
        except Exception as e:  # noqa: BLE001 -- any compile/launch error; see _triton_failed
            _triton_failed(e)
    if rows_to > x_MK.shape[0]:
        x_MK = torch.nn.functional.pad(x_MK, (0, 0, 0, rows_to - x_MK.shape[0]))
    r = quant.quantize_1x128(x_MK, ue8m0) if rows else None
    c = quant.quantize_1x128(x_MK.t(), ue8m0) if cols else None
    return (r, c) if rows and cols else (r if rows else c)


def quantize_rows_to(x_MK: torch.Tensor, ue8m0: bool, row_map: torch.Tensor, rows_out: int):
    """1x128 rows of ``x`` written to rows ``row_map`` of ``(q [rows_out, K], s [rows_out, K/128])``
    (``s`` column-major); other rows are left uninitialized. Triton does it in the quantizing pass."""
    if use_triton(x_MK):
        try:
            return kernels.quantize_act(x_MK, ue8m0, row_map=row_map, rows_out=rows_out)
        except Exception as e:  # noqa: BLE001
            _triton_failed(e)
    q, s = quant.quantize_1x128(x_MK, ue8m0)
    q_pad = torch.empty(rows_out, q.shape[1], dtype=torch.uint8, device=q.device)
    q_pad.index_copy_(0, row_map, q.view(torch.uint8))
    s_pad = torch.empty_strided((rows_out, s.shape[1]), (1, rows_out), device=s.device)
    s_pad.index_copy_(0, row_map, s)
    return q_pad.view(quant.FP8_DTYPE), s_pad


def quantize_weight(w: torch.Tensor, ue8m0: bool, transposed: bool = False):
    """128x128 blocks of ``w [..., N, K]``; with ``transposed`` also those of ``w^T`` (same blocks)."""
    if use_triton(w):
        try:
            return kernels.quantize_weight(w, ue8m0, transposed)
        except Exception as e:  # noqa: BLE001
            _triton_failed(e)
    q, s = quant.quantize_128x128(w, ue8m0)
    return ((q, s), transpose_blocks(q, s)) if transposed else (q, s)


def _weight_key(w: torch.Tensor, ue8m0: bool) -> tuple:
    """What a cached quantization of ``w`` is valid for: its storage, version (inference tensors have
    no version counter), shape, scale format and the optimizer steps so far."""
    version = -1 if w.is_inference() else w._version
    return (w.data_ptr(), version, tuple(w.shape), ue8m0, _STEP[0])


class WeightCache:
    """FP8 copy of one weight (and of its transpose), valid until the weight changes (see module note)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.q = self.s = self.qt = self.st = None

    def get(self, w: torch.Tensor, ue8m0: bool, transposed: bool = False, backward: bool = False):
        """The blocks of ``w`` (and ``w^T``). ``backward``: the weight is the one this step's forward
        used (autograd guarantees it), so its address is not compared: FSDP2 re-gathers the weight
        for the backward pass into storage that may sit elsewhere, with the same values."""
        key = _weight_key(w, ue8m0)
        hit = self.key is not None and (self.key[1:] == key[1:] if backward else self.key == key)
        if not hit or (transposed and self.qt is None):
            w = w.detach()
            if transposed:
                (self.q, self.s), (self.qt, self.st) = quantize_weight(w, ue8m0, True)
            else:
                (self.q, self.s), self.qt, self.st = quantize_weight(w, ue8m0), None, None
            self.key = key
        return ((self.q, self.s), (self.qt, self.st)) if transposed else (self.q, self.s)

    @torch.no_grad()
    def refresh_in_place(self, w: torch.Tensor, ue8m0: bool) -> bool:
        """Quantize a changed ``w`` into the blocks already held, whose storage a CUDA graph may read
        (the native engine's decode graphs replay the quantization they captured, not :meth:`get`);
        whether it had changed. Nothing held, or a weight of another shape, is left to :meth:`get`."""
        key = _weight_key(w, ue8m0)
        if self.key is None or self.key == key or self.key[2:4] != key[2:4]:
            return False
        w = w.detach()
        if self.qt is not None:
            (q, s), (qt, st) = quantize_weight(w, ue8m0, True)
            self.qt.copy_(qt)
            self.st.copy_(st)
        else:
            q, s = quantize_weight(w, ue8m0)
        self.q.copy_(q)
        self.s.copy_(s)
        self.key = key
        return True


def weight_fp8(w: torch.Tensor, cache: WeightCache | None, ue8m0: bool, transposed: bool = False,
               backward: bool = False):
    """``w``'s quantization (and its transpose's), from ``cache`` when given."""
    if cache is None:
        return quantize_weight(w.detach(), ue8m0, transposed)
    return cache.get(w, ue8m0, transposed, backward)


class _LastInput:
    """The quantization of the last activation seen, reused while the same tensor comes back unchanged."""

    def __init__(self) -> None:
        self.ref = None
        self.key: tuple | None = None
        self.value = None

    def get(self, x: torch.Tensor, ue8m0: bool, cols: bool, rows_to: int = 0):
        """``((q, s), (qt, st) or None)`` of ``x`` flattened to ``[M, K]`` (``q, s`` with zero rows
        appended up to ``rows_to``; not with ``cols``)."""
        x2 = x.reshape(-1, x.shape[-1])
        if x.is_inference():  # no version counter (torch.inference_mode): nothing to key a reuse on
            return quantize_act(x2, ue8m0, True, True) if cols else (quantize_act(x2, ue8m0, rows_to=rows_to), None)
        key = (x._version, ue8m0, tuple(x.shape), rows_to)
        if self.ref is not None and self.ref() is x and self.key == key and (self.value[1] is not None or not cols):
            return self.value
        self.value = quantize_act(x2, ue8m0, True, True) if cols else (quantize_act(x2, ue8m0, rows_to=rows_to), None)
        self.ref, self.key = weakref.ref(x), key
        return self.value


_LAST = _LastInput()


def quantize_input(x: torch.Tensor, ue8m0: bool, cols: bool, rows_to: int = 0):
    """Quantization of a linear's input ``x [..., K]`` (rows, with zero rows appended up to ``rows_to``;
    with ``cols`` also ``x^T`` for the weight gradient), shared with the previous linear when it read
    the same tensor the same way."""
    return _LAST.get(x, ue8m0, cols, rows_to)
