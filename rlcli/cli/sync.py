"""rl-sync: moves each new policy from the trainer to every inference server."""

from typing import Annotated, Optional

import typer

from rlcli.cli._errors import handle_errors
from rlcli.cli.common import (
    OVERRIDES, OVERRIDES_HELP, ConfigOpt, PrintConfigOpt, RunDirOpt, open_run, print_config, resolve_config, run_app,
)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command(context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-sync")
def main_cmd(
    ctx: typer.Context,
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    keep_weights: Annotated[Optional[int], typer.Option(help="Weight versions kept on disk.")] = None,
    print_config_: PrintConfigOpt = False,
) -> None:
    """Push every new policy from RUN/weights to all registered rl-infer servers and announce it."""
    cfg = resolve_config(ctx, config, {"run_dir": str(run_dir) if run_dir else None,
                                       "sync.keep_weights": keep_weights})
    if print_config_:
        return print_config(cfg)
    run = open_run(cfg, "sync")
    from rlcli.sync.syncer import run as sync

    raise typer.Exit(sync(cfg, run))


def main() -> None:
    run_app(app, "rl-sync")


if __name__ == "__main__":
    main()
