"""FP8 linears under FSDP2 (2 gloo ranks) train like one process: the FP8 weight cache is keyed on
the gathered weight and invalidated by every optimizer step, so no rank multiplies by a stale
weight after the sharded parameters move, and each weight is quantized once per step (the
backward's re-gather reuses the forward's FP8 copy); also with sibling linears stacked into one GEMM."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcli.ops.fp8.backends import EmulatedBackend
from rlcli.ops.fp8.linear import FP8Linear
from rlcli.ops.fp8.siblings import group_siblings

REPO = Path(__file__).resolve().parents[2]
STEPS, TOKENS, DIM, LAYERS = 3, 512, 256, 2  # 256 tokens per rank: wgrad's 128-token tiles are the same as in one process


class Gated(torch.nn.Module):
    """Two sibling FP8 linears on one input, stacked into one GEMM (rlcli.ops.fp8.siblings)."""

    def __init__(self, backend) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = (FP8Linear.from_linear(torch.nn.Linear(DIM, DIM, bias=False), backend)
                                        for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate_proj(x) * torch.sigmoid(self.up_proj(x))


def build(siblings: bool = False) -> torch.nn.Sequential:
    torch.manual_seed(0)
    if not siblings:
        return torch.nn.Sequential(*[FP8Linear.from_linear(torch.nn.Linear(DIM, DIM, bias=False), EmulatedBackend())
                                     for _ in range(LAYERS)])
    model = torch.nn.Sequential(*[Gated(EmulatedBackend()) for _ in range(LAYERS)])
    assert len(group_siblings(model, FP8Linear, ["gate_up"])) == LAYERS
    return model


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, DIM, generator=g)


@pytest.mark.parametrize("siblings", [False, True])
def test_fsdp2_fp8_training_matches_one_process_and_quantizes_once_per_step(tmp_path, siblings):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks: FSDP2's default mesh takes a GPU it sees
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(Path(__file__).with_name("dist_fp8_fsdp.py")), str(tmp_path), str(int(siblings))],
                          env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "fsdp.pt")
    assert got["counts"] == [LAYERS * (2 if siblings else 1)] * STEPS  # once (+ transpose) per weight per step

    model = build(siblings)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, dy = inputs()
    for step in range(STEPS):
        y = model(x.clone().requires_grad_())
        y.backward(dy / 2)
        # Not bitwise: FSDP sums gradients in another order, and a ~1e-7 difference in a weight that sits
        # on an FP8 rounding midpoint flips it (one column of the output moves by 2^-4 of that weight).
        # A stale FP8 weight would be far off: AdamW moves every weight by ~lr = 1e-2 (~20%) per step.
        assert _rel(got["outs"][step], y.detach()[:TOKENS // 2]) < 1e-2, step
        opt.step()
        opt.zero_grad()
        for p, q in zip(model.parameters(), got["params"][step]):
            assert _rel(q, p.detach()) < 1e-3, step


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())
