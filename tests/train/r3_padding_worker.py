"""Run by tests/train/test_r3.py under torchrun (gloo, 2 data-parallel ranks, each CP context-parallel
ranks: argv[3], default 1): rl-train's accumulation with r3 on, where data-parallel rank 1 holds
fewer rows than rank 0 (or none) and pads. For each scenario in OUT/batches/<scenario>/<dp rank>.msgpack
it writes this rank's metric sums to OUT/<scenario>_<rank>.pt, after all-reducing them stacked in key
order as the trainer does."""

import sys
from pathlib import Path

import torch

from rlcli.config.train import LossConfig, ParallelConfig
from rlcli.models import load_model
from rlcli.parallel import dist as pdist
from rlcli.parallel import resolve_dims
from rlcli.protocol.batch import decode_batch
from rlcli.train.loss import LOSSES
from rlcli.train.step import accumulate

OUT, MODEL = Path(sys.argv[1]), Path(sys.argv[2])
CP = int(sys.argv[3]) if len(sys.argv) > 3 else 1


def main() -> None:
    info = pdist.init_distributed()
    dims = resolve_dims(ParallelConfig(dp=2, cp=CP), info.world_size).build("cpu")
    dp_rank = dims.coords(info.rank)[0]
    model = load_model(MODEL, seed=3)
    if CP > 1:  # what parallelize does for --cp: each layer's attention all-gathers k and v
        from rlcli.parallel.context import apply_cp

        apply_cp(model, dims.mesh["cp"])
    for scenario in sorted(p.name for p in (OUT / "batches").iterdir()):
        batch = decode_batch((OUT / "batches" / scenario / f"{dp_rank}.msgpack").read_bytes())
        totals, _ = accumulate(model, batch.micro_batches, dims, torch.device("cpu"), LOSSES["tis"], LossConfig(),
                               1024, r3=True)
        model.zero_grad(set_to_none=True)
        keys = sorted(totals)
        pdist.all_reduce_sum(torch.stack([totals[k].float() for k in keys]))  # fails if the ranks' keys differ
        torch.save({k: totals[k].detach() for k in keys}, OUT / f"{scenario}_{info.rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
