"""Run by tests/parallel/test_fsdp.py under torchrun (gloo, 2 ranks): the trainer's own
pieces on real process groups. Writes what it computed (gathered on rank 0) under
``OUT/`` for the test to compare with a single-process run.

For each model in OUT/models/<name> with batches in OUT/batches/<name>/<dp_rank>.msgpack:
  * meta build -> parallelize (FSDP2 over 2 ranks, optional activation checkpointing) ->
    each rank loads its own slices -> publish sharded HF weights (OUT/pub_<name>/step_0);
  * one forward/backward over this rank's rows: loss and every gradient -> grads_<name>_<ac>.pt;
  * dense only: AdamW step, DCP checkpoint (OUT/run), second step -> params after each;
    then a fresh model + optimizer resumes from the checkpoint and redoes step 2; and with one
    byte of rank 1's shard of a newer checkpoint flipped, both ranks resume the one before.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from rlcli.config.train import LossConfig, ParallelConfig, TrainConfig
from rlcli.models import ModelArgs, build_model
from rlcli.parallel import parallelize, resolve_dims
from rlcli.parallel import dist as pdist
from rlcli.parallel.fsdp import clip_grad_norm_
from rlcli.parallel.loading import load_sharded
from rlcli.protocol.batch import decode_batch
from rlcli.train.async_checkpoint import AsyncCheckpointer
from rlcli.train.checkpoint import load_latest_checkpoint, save_checkpoint
from rlcli.train.loss import LOSSES
from rlcli.train.publish import FilesystemPublisher
from rlcli.train.step import accumulate
from rlcli.transport.rundir import RunDir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from integrity import flip_byte  # noqa: E402

OUT = Path(sys.argv[1])
# "fsdp": 2 ranks, --dp 2 (everything below); "epcp": 4 ranks, --dp 2 --cp 2 on the dense
# model and --dp 2 --cp 2 --ep 2 on the MoE (loss and gradients only).
MODE = sys.argv[2] if len(sys.argv) > 2 else "fsdp"
LCFG = LossConfig(entropy_coef=0.01)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build(name: str, dims, ac: str, reshard: str = "micro_batch"):
    args = ModelArgs.from_dir(OUT / "models" / name)
    model = build_model(args, device="meta", dtype=torch.float32, materialize=False)
    cfg = TrainConfig(activation_checkpointing=ac, parallel=ParallelConfig(reshard=reshard))
    parallelize(model, dims, cfg, torch.float32)
    model.to_empty(device="cpu")
    model.init_buffers()
    load_sharded(model, OUT / "models" / name)
    return model


def step(model, batch, dims, reshard: str = "micro_batch") -> torch.Tensor:
    """The trainer's accumulation over this rank's rows; the step's mean loss."""
    totals, normalizer = accumulate(model, batch.micro_batches, dims, torch.device("cpu"), LOSSES["icepop"], LCFG,
                                    chunk=7, reshard=reshard)
    return pdist.all_reduce_sum(totals["loss"]) / normalizer


def epcp_main(rank: int, world: int) -> None:
    for name, ep in (("dense", 1), ("moe", 2)):
        dims = resolve_dims(ParallelConfig(dp=2, cp=2, ep=ep), world, num_experts=6).build("cpu")
        batch = decode_batch((OUT / "batches" / name / f"{dims.coords(rank)[0]}.msgpack").read_bytes())
        model = build(name, dims, "none")
        loss = step(model, batch, dims)
        grads = {k: full(p.grad) for k, p in model.named_parameters()}
        norm = clip_grad_norm_(model.parameters(), 0.0)
        # Clipping to half the norm scales every gradient, dense (dp x cp mesh) and experts (ep mesh) alike.
        clip_grad_norm_(model.parameters(), float(norm) / 2)
        clipped = {k: full(p.grad) for k, p in model.named_parameters()}
        if rank == 0:
            torch.save({"loss": loss, "grads": grads, "norm": norm, "clipped": clipped}, OUT / f"grads_{name}_epcp.pt")


def main() -> None:
    info = pdist.init_distributed()
    rank = info.rank
    if MODE == "epcp":
        epcp_main(rank, info.world_size)
        dist.barrier()
        dist.destroy_process_group()
        return
    dims = resolve_dims(ParallelConfig(dp=2), info.world_size).build("cpu")
    for name in sorted(p.name for p in (OUT / "models").iterdir()):
        batch = decode_batch((OUT / "batches" / name / f"{dims.coords(rank)[0]}.msgpack").read_bytes())
        for ac in (["none", "selective", "full"] if name == "dense" else ["none"]):
            model = build(name, dims, ac)
            if ac == "none":
                cfg = SimpleNamespace(model=SimpleNamespace(path=str(OUT / "models" / name), dtype="float32"),
                                      train=SimpleNamespace(fp8=SimpleNamespace(enabled=False, publish=False)))
                FilesystemPublisher(cfg, OUT / f"pub_{name}", lambda *a: None).publish(0, model)
            loss = step(model, batch, dims)
            grads = {k: full(p.grad) for k, p in model.named_parameters()}
            norm = clip_grad_norm_(model.parameters(), 0.0)  # 0: measure only
            if rank == 0:
                torch.save({"loss": loss, "grads": grads, "norm": norm}, OUT / f"grads_{name}_{ac}.pt")
        if name != "dense":
            continue
        # Resume: step 1, checkpoint, step 2; then a fresh model resumes and redoes step 2.
        run = RunDir(OUT / "run")

        def fresh():
            model = build(name, dims, "none")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

        model, opt, sched = fresh()
        params = []
        for i in (1, 2):
            step(model, batch, dims)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            params.append({k: full(p).detach().clone() for k, p in model.named_parameters()})
            if i == 1:
                save_checkpoint(run, 1, model, opt, sched, {"step": 1}, keep=2, mesh={"dp": 2, "cp": 1, "ep": 1})
            # and both steps into OUT/run_fallback, whose newest gets one damaged shard below
            save_checkpoint(RunDir(OUT / "run_fallback"), i, model, opt, sched, {"step": i}, keep=2,
                            mesh={"dp": 2, "cp": 1, "ep": 1})
        model, opt, sched = fresh()
        extra = load_latest_checkpoint(run, model, opt, sched)
        # A flipped byte in rank 1's shard of the newest checkpoint: both ranks fall back to step 1 together.
        fallback = RunDir(OUT / "run_fallback")
        if rank == 1:
            flip_byte(fallback.checkpoint_dir(2) / "__1_0.distcp")
        dist.barrier()
        model_fb, opt_fb, sched_fb = fresh()
        extra_fb = load_latest_checkpoint(fallback, model_fb, opt_fb, sched_fb)
        torch.save({"step": extra_fb["step"], "params": {k: full(p).detach().clone() for k, p in model_fb.named_parameters()}},
                   OUT / f"fallback_{rank}.pt")
        step(model, batch, dims)
        opt.step()
        resumed = {k: full(p).detach().clone() for k, p in model.named_parameters()}
        # The same, the checkpoint written behind the step (AsyncCheckpointer): step 2 trains while
        # each rank's writer thread writes step 1's snapshot, its collectives on a gloo group of its own.
        writer = AsyncCheckpointer(RunDir(OUT / "run_async"), keep=2, mesh={"dp": 2, "cp": 1, "ep": 1},
                                   group=pdist.new_cpu_group())
        model, opt, sched = fresh()
        for i in (1, 2):
            step(model, batch, dims)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if i == 1:
                writer.save(1, model, opt, sched, {"step": 1})
        writer.close()
        model, opt, sched = fresh()
        extra_async = load_latest_checkpoint(RunDir(OUT / "run_async"), model, opt, sched)
        step(model, batch, dims)
        opt.step()
        resumed_async = {k: full(p).detach().clone() for k, p in model.named_parameters()}
        if rank == 0:
            torch.save({"step1": params[0], "step2": params[1], "resumed": resumed, "extra": extra,
                        "resumed_async": resumed_async, "extra_async": extra_async}, OUT / "resume.pt")
        # train.parallel.reshard = "step": every rank runs two rows (rank 1 a padding pass), gradients
        # accumulate unsharded and are reduced once; then the same two optimizer steps as above.
        model = build(name, dims, "none", reshard="step")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss = step(model, batch, dims, "step")
        grads = {k: full(p.grad) for k, p in model.named_parameters()}
        norm = clip_grad_norm_(model.parameters(), 0.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step(model, batch, dims, "step")
        opt.step()
        after = {k: full(p).detach().clone() for k, p in model.named_parameters()}
        if rank == 0:
            torch.save({"loss": loss, "grads": grads, "norm": norm}, OUT / f"grads_{name}_reshard_step.pt")
            torch.save(after, OUT / "reshard_step_params.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
