"""SwiGLU's gate, ``silu(gate) * up``, for training and inference: one kernel each way on CUDA.

In torch the gate is two kernels forward (the SiLU, then the product) and three backward (the
product's two gradients, then the SiLU's), each a pass over ``[tokens, width]`` tensors, and
autograd keeps ``silu(gate)`` besides ``gate`` and ``up`` for the backward. :func:`swiglu`
runs :func:`rlcli.ops.fused_kernels.silu_mul` forward and
:func:`~rlcli.ops.fused_kernels.silu_mul_backward` backward: five passes instead of nine
in training, and only ``gate`` and ``up`` kept. Compiled for the GPU, the kernels round where
torch rounds (the SiLU in the gate's dtype, each gradient of the product in its dtype) and take
CUDA's ``expf`` and IEEE divisions as torch's kernels do.

Elsewhere (the CPU, while ``torch.compile`` traces, which fuses the two ops itself, mixed
dtypes, tensor subclasses) it is ``F.silu(gate) * up``. A kernel that fails to compile or
launch is logged once and the torch ops take over for good.
"""

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("rlcli.ops")

_STATE = {"kernels": None, "tried": False}


def _kernels():
    """:mod:`rlcli.ops.fused_kernels`, or None where Triton does not import or a kernel failed here."""
    if not _STATE["tried"]:
        _STATE["tried"] = True
        try:
            from rlcli.ops import fused_kernels
        except (ImportError, OSError) as e:
            log.debug("triton does not import (%s): SwiGLU runs torch's ops", e)
        else:
            _STATE["kernels"] = fused_kernels
    return _STATE["kernels"]


def _failed(e: Exception) -> None:
    log.warning("swiglu: the Triton kernel failed (%s: %s); using torch's ops from now on", type(e).__name__,
                str(e)[:300])
    _STATE["kernels"] = None


class SwiGLUFn(torch.autograd.Function):
    """``silu(gate) * up`` through the fused kernels; the tensors on any device Triton runs on."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _STATE["kernels"].silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        k = _STATE["kernels"]
        if k is not None:
            try:
                return k.silu_mul_backward(gate, up, grad)
            except Exception as e:  # noqa: BLE001 -- any compile/launch error; see _failed
                _failed(e)
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)  # autograd's, through torch's ops


def serves(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether :func:`swiglu` runs the kernels for these (CUDA plain tensors of one dtype and shape)."""
    return (gate.is_cuda and type(gate) is torch.Tensor and type(up) is torch.Tensor and gate.dtype == up.dtype
            and gate.shape == up.shape and not torch.compiler.is_compiling() and _kernels() is not None)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``, fused on CUDA (module docstring)."""
    if serves(gate, up):
        try:
            return SwiGLUFn.apply(gate, up)
        except Exception as e:  # noqa: BLE001
            _failed(e)
    return F.silu(gate) * up
