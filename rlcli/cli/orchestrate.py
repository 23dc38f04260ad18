"""rl-orchestrate: the RL loop, the local launcher, and run status."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcli.cli._errors import handle_errors
from rlcli.errors import ConfigError, RunDirError
from rlcli.cli.common import (
    OVERRIDES, OVERRIDES_HELP, BatchInvariantOpt, ConfigOpt, EngineOpt, JsonAlwaysOpt, JsonRunOpt, PrintConfigOpt,
    R3Opt, RunDirOpt, SeedOpt, command_app, emit_json, finish, open_run, print_config, resolve_config, run_app,
)

app = command_app("rl-orchestrate", "The RL loop: tasks, rewards, advantages, bounded off-policy batching.",
                  no_args_is_help=True)

MaxAsyncOpt = Annotated[Optional[int], typer.Option("--max-async", help="Steps the orchestrator may run ahead "
                                                    "of the trainer; 0 is synchronous RL.")]
MaxOffPolicyOpt = Annotated[Optional[int], typer.Option(
    "--max-off-policy-steps", help="Most policy versions a trained token may lag [default: --max-async]; above "
                                   "it, stragglers are trained late instead of holding up a batch.")]
StepsOpt = Annotated[Optional[int], typer.Option("--steps", help="RL steps [default: num_steps].")]


@app.command("run", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-orchestrate")
def run_cmd(
    ctx: typer.Context,
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    steps: StepsOpt = None,
    max_async: MaxAsyncOpt = None,
    max_off_policy_steps: MaxOffPolicyOpt = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Prompts per step.")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="Completions per prompt.")] = None,
    connect: Annotated[Optional[list[str]], typer.Option(help="rl-infer endpoint (repeatable) instead of "
                                                         "the registry.")] = None,
    seed: SeedOpt = None,
    r3: R3Opt = None,
    print_config_: PrintConfigOpt = False,
    json_: JsonRunOpt = False,
) -> None:
    """Run the RL loop against the inference servers of a run directory."""
    cfg = resolve_config(ctx, config, {"run_dir": str(run_dir) if run_dir else None, "num_steps": steps,
                                       "orchestrate.max_async": max_async,
                                       "orchestrate.max_off_policy_steps": max_off_policy_steps,
                                       "orchestrate.batch_size": batch_size,
                                       "orchestrate.group_size": group_size, "orchestrate.connect": connect,
                                       "seed": seed, "r3": r3})
    if print_config_:
        return print_config(cfg, json_)
    from rlcli.transport.zmq import check_endpoint, name_bind_keys

    for endpoint in cfg.orchestrate.connect:
        check_endpoint(endpoint, "--connect/orchestrate.connect")
    name_bind_keys("--orchestrate.host")
    from rlcli.orchestrate.entrypoints import orchestrate, prepare

    env, tokenizer = prepare(cfg)
    run = open_run(cfg, "orchestrate")
    finish(run, "orchestrate", orchestrate(cfg, run, env, tokenizer), json_)


@app.command("up", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-orchestrate")
def up_cmd(
    ctx: typer.Context,
    recipe: Annotated[Path, typer.Argument(help="TOML recipe (see recipes/).")],
    run_dir: RunDirOpt = None,
    steps: StepsOpt = None,
    max_async: MaxAsyncOpt = None,
    max_off_policy_steps: MaxOffPolicyOpt = None,
    num_infer: Annotated[Optional[int], typer.Option(help="rl-infer servers to launch.")] = None,
    engine: EngineOpt = None,
    plot: Annotated[Optional[bool], typer.Option("--plot/--no-plot", help="Write RUN/reward.png at the end.")] = None,
    fp8: Annotated[bool, typer.Option("--fp8", help="FP8 GEMMs in trainer and engines (train/infer.fp8.enabled).")] = False,
    seed: SeedOpt = None,
    r3: R3Opt = None,
    batch_invariant: BatchInvariantOpt = False,
    train_nproc: Annotated[Optional[int], typer.Option(help="rl-train ranks (torchrun --nproc-per-node); also sets "
                                                       "orchestrate.num_train_ranks to its data-parallel ranks "
                                                       "(train.parallel.dp, or these over train.parallel.cp).")] = None,
    print_config_: PrintConfigOpt = False,
    json_: Annotated[bool, typer.Option("--json", help="The summary is always JSON; with --print-config, the "
                                        "recipe as JSON too.")] = False,
) -> None:
    """Launch every process of a recipe on this machine, show the live dashboard, stop them all at the end."""
    on = True if fp8 else None
    flags = {"run_dir": str(run_dir) if run_dir else None, "num_steps": steps,
             "orchestrate.max_async": max_async, "orchestrate.max_off_policy_steps": max_off_policy_steps,
             "up.num_infer": num_infer,
             "up.plot": plot, "infer.engine.name": engine.value if engine else None,
             "train.fp8.enabled": on, "infer.fp8.enabled": on, "seed": seed,
             "r3": r3, "up.train_nproc_per_node": train_nproc,
             "model.batch_invariant": True if batch_invariant else None}
    cfg = resolve_config(ctx, recipe, flags)
    if train_nproc:  # one rollout file per data-parallel rank; context-parallel ranks share theirs
        p = cfg.train.parallel
        dp = p.dp if p.dp > 0 else max(train_nproc // p.cp, 1)
        cfg = resolve_config(ctx, recipe, {**flags, "orchestrate.num_train_ranks": dp})
    if print_config_:
        return print_config(cfg, json_)
    from rlcli.orchestrate.launcher import preflight, up

    preflight(cfg)
    run = open_run(cfg, "up")

    code, summary = up(cfg, run)
    emit_json(summary)
    raise typer.Exit(code)


@app.command("status")
@handle_errors("rl-orchestrate")
def status_cmd(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object instead of the table.")] = False,
    watch: Annotated[Optional[float], typer.Option(
        "--watch", help="Redraw every SECONDS as a live dashboard (recent steps and every process) until Ctrl-C.",
        metavar="SECONDS", show_default=False)] = None,
) -> None:
    """Every process of a run (alive, busy, or dead or stopped; version; lag) and its progress."""
    from rlcli.orchestrate.entrypoints import render_status, status, watch_status

    if watch is not None:
        if json_out or not 0 < watch < float("inf"):
            raise ConfigError("--watch takes a positive number of seconds and no --json (use --json without "
                             "--watch for one snapshot)")
        check_run_json(run_dir)
        return watch_status(run_dir, watch)
    check_run_json(run_dir)
    s = status(run_dir)
    if json_out:
        emit_json(s)
    else:
        print(render_status(s), flush=True)


@app.command("rewind")
@handle_errors("rl-orchestrate")
def rewind_cmd(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (its processes stopped).")],
    to: Annotated[int, typer.Option("--to", help="The checkpoint step to go back to (0: policy 0).",
                                    show_default=False)],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be removed; change nothing.")] = False,
    json_: JsonAlwaysOpt = False,
) -> None:
    """Take a stopped run back to a checkpoint: later checkpoints, weights, batches and metrics records go;
    started again, every process goes on from step N. Prints what was removed as JSON."""
    from rlcli.orchestrate.rewind import rewind

    check_run_json(run_dir)
    emit_json(rewind(run_dir, to, dry_run))


def check_run_json(run_dir: Path) -> None:
    """A RunDirError if RUN/run.json exists but is not the object a run writes (a status of a
    damaged run would otherwise show an empty table as if nothing had run)."""
    from rlcli.transport.atomic import read_json, why_unreadable

    path = run_dir / "run.json"
    if not path.is_file():
        return  # status() says it is no run directory
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, or bytes that are not UTF-8
        raise RunDirError(f"{path} is unreadable or damaged ({why_unreadable(e)}); is {run_dir} a run directory?") from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise RunDirError(f"{path} is damaged (not a run's record: no recipe name); is {run_dir} a run directory?")


def _at_least(flag: str, value: int, low: int = 1) -> None:
    if value < low:
        raise ConfigError(f"{flag} must be >= {low}, got {value}")


@app.command("plot")
@handle_errors("rl-orchestrate")
def plot_cmd(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    out: Annotated[Optional[Path], typer.Option(help="PNG to write [default: RUN/reward.png].",
                                                show_default=False)] = None,
    json_: JsonAlwaysOpt = False,
) -> None:
    """Draw reward, mismatch KL, throughput and off-policy lag of a run as a PNG (needs matplotlib)."""
    from rlcli.orchestrate.plot import plot_run
    from rlcli.transport.rundir import RunDir

    if not (run_dir / "run.json").is_file():
        raise RunDirError(f"{run_dir} is not a run directory (no run.json)")
    check_run_json(run_dir)
    emit_json({"plot": str(plot_run(RunDir(run_dir), out))})


EnvOpt = Annotated[Optional[str], typer.Option("--env", help="Environment: a built-in (reverse, math, tool-use, "
                                                "...), an entry point or package.module:factory [default: the "
                                                "recipe's env].", show_default=False)]


def _env_config(ctx: typer.Context, config: Optional[Path], env: Optional[str]):
    return resolve_config(ctx, config, {"env.name": env}).env


@app.command("tasks", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-orchestrate")
def tasks_cmd(
    ctx: typer.Context,
    config: ConfigOpt = None,
    env: EnvOpt = None,
    num: Annotated[int, typer.Option("-n", "--num", help="Tasks to sample.")] = 16,
    seed: Annotated[int, typer.Option(help="Task-sampling seed.")] = 0,
    json_: JsonAlwaysOpt = False,
) -> None:
    """Sample tasks from an environment as JSON lines (prompt, answer, info) for a pipeline."""
    _at_least("-n/--num", num)
    from rlcli.orchestrate.pipeline import sample_tasks, write_records

    write_records(sample_tasks(_env_config(ctx, config, env), num, seed))


@app.command("score", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-orchestrate")
def score_cmd(
    ctx: typer.Context,
    config: ConfigOpt = None,
    env: EnvOpt = None,
    json_: JsonAlwaysOpt = False,
) -> None:
    """Score completions: JSON lines in (prompt, answer, completions), the same with rewards out."""
    import sys

    from rlcli.orchestrate.pipeline import read_records, score_records, write_records

    write_records(score_records(_env_config(ctx, config, env), read_records(sys.stdin)))


@app.command("eval", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-orchestrate")
def eval_cmd(
    ctx: typer.Context,
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    env: EnvOpt = None,
    connect: Annotated[Optional[str], typer.Option(help="rl-infer endpoint instead of the run's registry.")] = None,
    num: Annotated[int, typer.Option("-n", "--num", help="Tasks.")] = 64,
    k: Annotated[int, typer.Option("-k", help="Samples per task: reports pass@1 and pass@k.")] = 4,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    max_tokens: Annotated[int, typer.Option(help="Most tokens per completion.")] = 64,
    threshold: Annotated[float, typer.Option(help="A completion passes when its reward is >= this.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Task-sampling seed (the same tasks for every version).")] = 1234,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each answer.")] = 300.0,
    json_: JsonAlwaysOpt = False,
) -> None:
    """Evaluate the policy a live rl-infer serves on an environment: pass@k and mean reward as JSON."""
    from rlcli.infer.client import check_sampling_flags, generate_texts
    from rlcli.orchestrate.pipeline import sample_tasks, score_records, summarize_eval

    _at_least("-n/--num", num)
    if threshold != threshold or abs(threshold) == float("inf"):  # nan would pass nothing and print no JSON
        raise ConfigError(f"--threshold must be a finite reward, got {threshold}")
    check_sampling_flags(max_tokens=max_tokens, temperature=temperature, n=k, timeout=timeout, n_flag="-k")
    if connect is not None:
        from rlcli.transport.zmq import check_endpoint

        check_endpoint(connect, "--connect")
    cfg = resolve_config(ctx, config, {"run_dir": str(run_dir) if run_dir else None, "env.name": env})
    tasks = list(sample_tasks(cfg.env, num, seed))
    generated = [{**task, **result} for task, (_, result) in zip(tasks, generate_texts(
        tasks, run_dir=Path(cfg.run_dir), connect=connect, model=None, max_tokens=max_tokens,
        temperature=temperature, n=k, timeout=timeout))]
    emit_json(summarize_eval(list(score_records(cfg.env, generated)), k, threshold))


def main() -> None:
    run_app(app, "rl-orchestrate")


if __name__ == "__main__":
    main()
