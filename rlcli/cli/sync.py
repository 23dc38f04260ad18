"""rl-sync: moves each new policy from the trainer to every inference server."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcli.cli._errors import handle_errors
from rlcli.cli.common import (
    OVERRIDES, OVERRIDES_HELP, ConfigOpt, JsonOpt, JsonRunOpt, PrintConfigOpt, RunDirOpt, command_app, emit_json,
    finish, open_run, print_config, resolve_config, run_app,
)

app = command_app("rl-sync", "Coordinates weight updates: orders loads, collects acks, announces the policy.")


@app.command("run", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-sync")
def run_cmd(
    ctx: typer.Context,
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    keep_weights: Annotated[Optional[int], typer.Option(help="Weight versions kept on disk.")] = None,
    print_config_: PrintConfigOpt = False,
    json_: JsonRunOpt = False,
) -> None:
    """Have every registered rl-infer server load each new policy and announce it."""
    cfg = resolve_config(ctx, config, {"run_dir": str(run_dir) if run_dir else None,
                                       "sync.keep_weights": keep_weights})
    if print_config_:
        return print_config(cfg, json_)
    from rlcli.transport.zmq import name_bind_keys

    name_bind_keys("--sync.host")
    run = open_run(cfg, "sync")
    from rlcli.sync.syncer import run as sync

    finish(run, "sync", sync(cfg, run), json_)


@app.command("status")
@handle_errors("rl-sync")
def status_cmd(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    json_: JsonOpt = False,
) -> None:
    """Each server's version and state, and the last update's timing (gather, send/write, load)."""
    from rlcli.errors import RunDirError
    from rlcli.sync.status import read_status, render

    status = read_status(run_dir)
    if status is None:
        raise RunDirError(f"{run_dir} has no sync/status.json; is rl-sync running on this run directory?")
    if json_:
        emit_json(status)
    else:
        typer.echo(render(status))


def main() -> None:
    run_app(app, "rl-sync", "run")


if __name__ == "__main__":
    main()
