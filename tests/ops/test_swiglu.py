"""rlcli.ops.swiglu's choice of path and its fallback: torch's two ops where the kernels do not
serve, and where a kernel fails (then for good, with the gradients autograd would give). The
kernels themselves are checked against torch in tests/ops/test_fused_kernels.py."""

import logging

import torch
import torch.nn.functional as F

from rlcli.ops import swiglu


def _grads(g, u, dh):
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = swiglu.swiglu(g, u)
    h.backward(dh)
    return h, g.grad, u.grad


def _torch_grads(g, u, dh):
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = F.silu(g) * u
    h.backward(dh)
    return h, g.grad, u.grad


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 40, generator=gen) * 3).to(dtype) for _ in range(3)]


def test_on_the_cpu_it_is_torchs_two_ops():
    g, u, dh = _inputs(torch.bfloat16)
    h = swiglu.swiglu(g.clone().requires_grad_(), u)
    assert h.grad_fn.name() == "MulBackward0"
    for x, y in zip(_grads(g, u, dh), _torch_grads(g, u, dh)):
        assert torch.equal(x, y)


class _Broken:
    """Kernels that raise, as a Triton compile error would; ``forward_works``: the forward is torch's."""

    def __init__(self, forward_works: bool):
        self.forward_works = forward_works

    def silu_mul(self, gate, up):
        if self.forward_works:
            return F.silu(gate) * up
        raise RuntimeError("PassManager::run failed")

    def silu_mul_backward(self, gate, up, grad):
        raise RuntimeError("PassManager::run failed")


def test_a_failing_kernel_falls_back_to_torch_for_good(monkeypatch, caplog):
    g, u, dh = _inputs(torch.bfloat16)
    want = _torch_grads(g, u, dh)
    monkeypatch.setattr(swiglu, "serves", lambda gate, up: swiglu._STATE["kernels"] is not None)
    swiglu.log.addHandler(caplog.handler)
    try:
        for forward_works in (False, True):
            monkeypatch.setitem(swiglu._STATE, "kernels", _Broken(forward_works))
            got = _grads(g, u, dh)
            for x, y in zip(got, want):  # the backward's fallback is autograd's own formula: the same bits
                assert torch.equal(x, y)
            assert swiglu._STATE["kernels"] is None  # for good: later calls take torch's ops
    finally:
        swiglu.log.removeHandler(caplog.handler)
    warnings = [r.getMessage() for r in dict.fromkeys(caplog.records) if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("using torch's ops from now on" in w for w in warnings)
