"""Run by tests/parallel/test_shared_prompts_cp.py under torchrun (gloo, 2 ranks, --cp 2): the
trainer's accumulation over a shared-prompt batch whose prompts are cut across the CP ranks,
for each model named in argv[2] (argv[1]: OUT). Writes the step's mean loss and every full gradient (rank 0) to OUT/cp_<name>.pt."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlcli.config.train import LossConfig, ParallelConfig, TrainConfig
from rlcli.models import ModelArgs, build_model
from rlcli.parallel import parallelize, resolve_dims
from rlcli.parallel import dist as pdist
from rlcli.parallel.loading import load_sharded
from rlcli.protocol.batch import decode_batch
from rlcli.train.loss import LOSSES
from rlcli.train.step import accumulate

OUT = Path(sys.argv[1])
LCFG = LossConfig(entropy_coef=0.01)


def main() -> None:
    info = pdist.init_distributed()
    dims = resolve_dims(ParallelConfig(cp=2), info.world_size).build("cpu")
    for name in sys.argv[2].split(","):
        args = ModelArgs.from_dir(OUT / name)
        model = build_model(args, device="meta", dtype=torch.float32, materialize=False)
        parallelize(model, dims, TrainConfig(), torch.float32)
        model.to_empty(device="cpu")
        model.init_buffers()
        load_sharded(model, OUT / name)
        batch = decode_batch((OUT / f"batch_{name}.msgpack").read_bytes())
        totals, normalizer = accumulate(model, batch.micro_batches, dims, torch.device("cpu"), LOSSES["icepop"],
                                        LCFG, chunk=7, r3=name != "dense")
        loss = pdist.all_reduce_sum(totals["loss"]) / normalizer
        grads = {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for k, p in model.named_parameters() if p.grad is not None}
        if info.rank == 0:
            torch.save({"loss": loss, "grads": grads}, OUT / f"cp_{name}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
