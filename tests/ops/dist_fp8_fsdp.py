"""Run by tests/ops/test_fp8_fsdp.py under torchrun (gloo, 2 ranks): a stack of FP8 linears
sharded with FSDP2 (each layer, then the root; resharded after forward, so the backward gathers
again), trained 3 AdamW steps on this rank's half of the batch (argv[2] == "1": layers of two sibling
linears stacked into one GEMM). Rank 0 writes the full
parameters after every step, its outputs, and how many times each weight was quantized, to OUT/fsdp.pt."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from rlcli.ops.fp8 import runtime
from tests.ops.test_fp8_fsdp import STEPS, TOKENS, build, inputs

OUT = Path(sys.argv[1])
SIBLINGS = len(sys.argv) > 2 and sys.argv[2] == "1"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(SIBLINGS)
    for layer in model:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counts = []
    quantize = runtime.quantize_weight

    def counting(w, *a, **k):
        counts[-1] += 1
        return quantize(w, *a, **k)

    runtime.quantize_weight = counting
    x, dy = inputs()
    half = slice(rank * TOKENS // 2, (rank + 1) * TOKENS // 2)
    params, outs = [], []
    for _ in range(STEPS):
        counts.append(0)
        y = model(x[half].clone().requires_grad_())
        y.backward(dy[half] / 2)
        outs.append(y.detach())  # the mean over ranks of the half-batch sums = the full-batch sum / 2
        opt.step()
        opt.zero_grad()
        params.append([p.full_tensor() for p in model.parameters()])
    if rank == 0:
        torch.save({"params": params, "outs": outs, "counts": counts}, OUT / "fsdp.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
