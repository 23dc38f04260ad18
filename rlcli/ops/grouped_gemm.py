"""One grouped GEMM for all experts of an MoE layer.

``grouped_mm(x_RK, w_ENK, offs_E)`` multiplies rows ``offs[e-1]:offs[e]`` of ``x`` (tokens
sorted by expert) by ``w[e]^T``, for every expert in one kernel launch, with the token
counts staying on the device: no host sync, no Python loop over experts. ``offs`` is the
int32 cumulative row end per expert (``torch.cumsum(counts, 0, dtype=torch.int32)``).

It runs ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on torch versions that
have no public name) where the kernel exists: CUDA bf16 (CUTLASS on sm90) and, from torch
2.13, CPU. Elsewhere (CUDA fp32, older CPU builds) it falls back to a loop over experts,
which reads ``offs`` on the host: that fallback syncs and is meant for CPU tests only.
The kernels need 16-byte aligned rows (in forward and backward), so matrices whose
width is not a multiple of 16 bytes take the loop too.
Which path a (device, dtype) takes is decided by trying the kernel once and cached.
"""

import torch
import torch.nn.functional as F

_grouped_mm_op = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_works: dict[tuple[str, torch.dtype], bool] = {}


def _kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    key = (device.type, dtype)
    if key not in _works:
        ok = _grouped_mm_op is not None and (device.type != "cuda" or dtype == torch.bfloat16)
        if ok:
            try:
                a = torch.zeros(4, 8, device=device, dtype=dtype)
                b = torch.zeros(2, 8, 8, device=device, dtype=dtype)
                _grouped_mm_op(a, b.transpose(-2, -1), offs=torch.tensor([2, 4], device=device, dtype=torch.int32))
            except (RuntimeError, NotImplementedError):
                ok = False
        _works[key] = ok
    return _works[key]


def kgrouped_available(dy_RN: torch.Tensor, x_RK: torch.Tensor) -> bool:
    """Whether the k-grouped form (``dy[rows of g]^T @ x[rows of g]`` for every group in one call,
    a weight gradient) runs for these operands: the kernel exists here and rows are 16-byte aligned."""
    aligned = all(n * dy_RN.element_size() % 16 == 0 for n in (dy_RN.shape[1], x_RK.shape[1]))
    return dy_RN.dtype == x_RK.dtype and aligned and _kernel_available(dy_RN.device, dy_RN.dtype)


def grouped_mm_loop(x_RK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                    expert_mm=None) -> torch.Tensor:
    """The reference: one matmul per expert (host sync on ``offs``); ``expert_mm(rows, e)``
    replaces ``rows @ w[e].T`` (model.batch_invariant's blocked expert GEMMs)."""
    ends = offs_E.tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        rows = x_RK[start:end]
        outs.append(rows @ w_ENK[e].T if expert_mm is None else expert_mm(rows, e))
        start = end
    out = torch.cat(outs) if outs else x_RK.new_zeros(0, w_ENK.shape[1])
    if x_RK.shape[0] > start:  # rows past the last offset belong to no expert
        out = torch.cat([out, out.new_zeros(x_RK.shape[0] - start, out.shape[1])])
    return out


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """The local shard of an expert-parallel (DTensor) weight, with autograd; plain tensors pass."""
    to_local = getattr(w, "to_local", None)
    return to_local() if to_local is not None else w


def grouped_mm(x_RK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``x[offs[e-1]:offs[e]] @ w[e].T`` for every expert ``e``, as ``[R, N]``. A DTensor
    ``w`` (experts sharded by expert parallelism) contributes its local experts."""
    w_ENK = local_weight(w_ENK)
    aligned = all(n * x_RK.element_size() % 16 == 0 for n in w_ENK.shape[1:])
    if aligned and _kernel_available(x_RK.device, x_RK.dtype):
        # The kernels want a contiguous row-major A; B = w^T is the column-major view they expect.
        return _grouped_mm_op(x_RK.contiguous(), w_ENK.transpose(-2, -1), offs=offs_E)
    return grouped_mm_loop(x_RK, w_ENK, offs_E)
