"""MoE and MLA layers under ``model.batch_invariant`` (:mod:`rlcli.ops.batch_invariant`, whose module
docstring says what each mixin changes and why): routers, experts, the combine of a token's expert
outputs, and MLA's latent form in the trainer. :func:`rlcli.ops.batch_invariant.make_batch_invariant`
swaps them in."""

import torch
import torch.nn.functional as F

from rlcli.ops.batch_invariant import _BlockedLinearFn, _KernelLinearFn, blocked_rows, invariant_kernels, on_kernels


class _InvariantRouter:
    """Mixin in front of an MoE router's class: its linear on blocked rows (CPU) or by the ``mm``
    kernel (CUDA)."""

    def logits(self, x_ND: torch.Tensor) -> torch.Tensor:
        fn = _KernelLinearFn if on_kernels(x_ND) else _BlockedLinearFn if x_ND.device.type == "cpu" else None
        if fn is None:
            return super().logits(x_ND)
        if self.scoring == "sigmoid":
            return fn.apply(x_ND.float(), self.weight.float(), None)
        return fn.apply(x_ND, self.weight, None)


class _KernelGroupedFn(torch.autograd.Function):
    """:func:`rlcli.ops.grouped_gemm.grouped_mm` whose forward is the invariant ``grouped_mm`` kernel
    (CUDA); backward by torch's grouped GEMMs (or a loop where they do not run)."""

    @staticmethod
    def forward(ctx, x_RK, w_ENK, offs_E):
        ctx.save_for_backward(x_RK, w_ENK, offs_E)
        return invariant_kernels().grouped_mm(x_RK, w_ENK, offs_E)

    @staticmethod
    def backward(ctx, dy_RN):
        from rlcli.ops.grouped_gemm import _grouped_mm_op, grouped_mm, kgrouped_available

        x_RK, w_ENK, offs_E = ctx.saved_tensors
        dy_RN = dy_RN.contiguous()  # the k-grouped GEMM reads dy^T as a column-major matrix
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx[rows of e] = dy[rows of e] @ w[e]
            dx = grouped_mm(dy_RN, w_ENK.transpose(-2, -1), offs_E)
        if ctx.needs_input_grad[1]:  # dw[e] = dy[rows of e]^T @ x[rows of e]
            if kgrouped_available(dy_RN, x_RK):
                dw = _grouped_mm_op(dy_RN.t(), x_RK, offs=offs_E)
            else:  # fp32 experts on CUDA: a loop (one host sync)
                dw = torch.zeros_like(w_ENK)
                start = 0
                for e, end in enumerate(offs_E.tolist()):
                    dw[e] = dy_RN[start:end].t() @ x_RK[start:end]
                    start = end
        return dx, dw, None


class _InvariantExperts:
    """Mixin in front of an MoE experts class. On CUDA the grouped GEMMs run the invariant
    ``grouped_mm`` kernel (bf16 / fp32 experts, :class:`_KernelGroupedFn`) or, for FP8 experts, their
    backend's ``grouped_gemm`` wrapped in :class:`KernelGemm` (``fp8_grouped_mm``). On the CPU each
    expert's GEMM runs on its own rows in :func:`blocked_rows` (the grouped GEMM's per-expert row
    counts follow the batch); FP8 experts quantize per row and per expert as before, without the
    weight cache (whose backward lookup does not tell one expert's slice from another's). One host
    sync per GEMM there."""

    def expert_mm(self, x_RK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        from rlcli.ops.fp8.linear import fp8_grouped_mm
        from rlcli.ops.grouped_gemm import grouped_mm, grouped_mm_loop, local_weight

        fp8 = getattr(self, "backend", None) is not None
        if on_kernels(x_RK):
            if fp8:
                return super().expert_mm(x_RK, w_ENK, offs_E)
            return _KernelGroupedFn.apply(x_RK, local_weight(w_ENK), offs_E)
        if x_RK.device.type != "cpu":
            return super().expert_mm(x_RK, w_ENK, offs_E)
        w_ENK = local_weight(w_ENK)

        def one_expert(rows: torch.Tensor, e: int) -> torch.Tensor:
            offs = torch.tensor([rows.shape[0]], dtype=torch.int32)
            if fp8:
                return fp8_grouped_mm(rows, w_ENK[e:e + 1], offs, self.backend, None, self.ue8m0)
            return grouped_mm(rows, w_ENK[e:e + 1], offs)

        def blocked(rows: torch.Tensor, e: int) -> torch.Tensor:
            if rows.shape[0] == 0:  # an expert no token chose
                return rows.new_zeros(0, w_ENK.shape[1])
            return blocked_rows(lambda block: one_expert(block, e), rows)

        return grouped_mm_loop(x_RK, w_ENK, offs_E, blocked)


class _InvariantMoE:
    """Mixin in front of an MoE layer's class: a token's ``k`` weighted expert outputs are added
    in slot order, each rounded to the model dtype (the batched product of the plain layer picks
    its kernel by the token count)."""

    def combine(self, y_NkD: torch.Tensor, gates_Nk: torch.Tensor) -> torch.Tensor:
        y_NkD = y_NkD * gates_Nk.to(y_NkD.dtype)[:, :, None]
        out = y_NkD[:, 0]
        for j in range(1, y_NkD.shape[1]):
            out = out + y_NkD[:, j]
        return out


def head_linear(x_BTHK: torch.Tensor, w_HNK: torch.Tensor) -> torch.Tensor:
    """``x[:, :, h] @ w[h]^T`` for every head, ``[B, T, H, N]``: each head a linear on invariant rows
    (blocked on the CPU, the ``mm`` kernel on CUDA; torch's batched GEMMs pick kernels by the row
    count). Differentiable. MLA's absorbed projections (:class:`_InvariantMLA`)."""
    B, T, H, K = x_BTHK.shape
    kernels = on_kernels(x_BTHK)
    outs = []
    for h in range(H):
        x_MK = x_BTHK[:, :, h].reshape(B * T, K)
        if kernels:
            y = _KernelLinearFn.apply(x_MK, w_HNK[h], None)
        elif x_MK.device.type == "cpu":
            y = _BlockedLinearFn.apply(x_MK, w_HNK[h], None)
        else:
            y = F.linear(x_MK, w_HNK[h])
        outs.append(y.view(B, T, -1))
    return torch.stack(outs, dim=2)


class _FakeQuant128(torch.autograd.Function):
    """A master weight through its 128x128 FP8 quantization and back (the weight an FP8 engine holds),
    gradient straight through."""

    @staticmethod
    def forward(ctx, w, ue8m0: bool, dtype: torch.dtype):
        from rlcli.ops.fp8.quant import dequantize_128x128, quantize_128x128

        ctx.dtype = w.dtype
        return dequantize_128x128(*quantize_128x128(w, ue8m0), dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None, None


class _InvariantMLA:
    """Mixin in front of an MLA layer's class: the trainer attends in the engine's latent form too
    (dense MLA: one latent K/V head, through the attention backend on packed rows, the invariant one
    under the flag; DSA: the indexer's top-k and the sparse attention in their invariant forms,
    :class:`rlcli.ops.mla.SparseLatentAttention`), the absorbed projections are :func:`head_linear`,
    and an FP8 ``kv_b_proj`` on a master weight is absorbed as the FP8 engine holds it (quantized,
    dequantized)."""

    batch_invariant = True

    def _latent_form(self, ctx) -> bool:
        return True

    def _kv_b_weight(self, dtype: torch.dtype) -> torch.Tensor:
        lin = self.kv_b_proj
        if getattr(lin, "backend", None) is not None and lin.weight.dtype.itemsize != 1:
            return _FakeQuant128.apply(lin.weight, lin.ue8m0, dtype)
        return super()._kv_b_weight(dtype)

    @staticmethod
    def _absorb_q(q_nope_BTHD: torch.Tensor, w_uk_HDR: torch.Tensor) -> torch.Tensor:
        return head_linear(q_nope_BTHD, w_uk_HDR.transpose(1, 2))

    @staticmethod
    def _expand_out(out_BTHR: torch.Tensor, w_uv_HVR: torch.Tensor) -> torch.Tensor:
        return head_linear(out_BTHR, w_uv_HVR)
