"""rl-cache: the shared KV-block store and a client to query it."""

from typing import Annotated, Optional

import typer

from rlcli.cli._errors import handle_errors
from rlcli.cli.common import (
    OVERRIDES, OVERRIDES_HELP, ConfigOpt, JsonConfigOpt, JsonOpt, PrintConfigOpt, RunDirOpt, emit_json, open_run, print_config,
    resolve_config, run_app,
)

app = typer.Typer(help="Shared KV-cache block store.", add_completion=False, pretty_exceptions_enable=False,
                  no_args_is_help=True)


@app.command("serve", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-cache")
def serve(
    ctx: typer.Context,
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    host: Annotated[Optional[str], typer.Option(help="Interface to bind [default: cache.host].")] = None,
    port: Annotated[Optional[int], typer.Option(help="TCP port; 0 picks a free one.")] = None,
    capacity_mb: Annotated[Optional[int], typer.Option(help="Byte capacity in MiB.")] = None,
    print_config_: PrintConfigOpt = False,
    json_: JsonConfigOpt = False,
) -> None:
    """Run the block store (registers in the run directory when a recipe or --run-dir is given)."""
    cfg = resolve_config(ctx, config, {"run_dir": str(run_dir) if run_dir else None, "cache.host": host,
                                       "cache.port": port, "cache.capacity_mb": capacity_mb})
    if print_config_:
        return print_config(cfg, json_)
    run = open_run(cfg, "cache") if (config or run_dir) else None
    from rlcli.cache.server import serve as serve_forever

    raise typer.Exit(serve_forever(cfg, run))


@app.command("stats")
@handle_errors("rl-cache")
def stats(
    run_dir: RunDirOpt = None,
    connect: Annotated[Optional[str], typer.Option(help="Store endpoint (tcp://host:port).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the answer.")] = 5.0,
    json_: JsonOpt = False,
) -> None:
    """Print the store's counters (blocks, bytes, hits, misses, evictions)."""
    from rlcli.cache.client import query_stats

    result = query_stats(run_dir, connect, timeout)
    if json_:
        emit_json(result)
    else:
        for key, value in result.items():
            print(f"{key:>16}  {value}")


def main() -> None:
    run_app(app, "rl-cache")


if __name__ == "__main__":
    main()
