"""rl-cache: the shared KV-block store and a client to query it."""

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcli.cli._errors import handle_errors
from rlcli.cli.common import (
    OVERRIDES, OVERRIDES_HELP, ConfigOpt, JsonConfigOpt, JsonOpt, PrintConfigOpt, RunDirOpt, command_app, emit_json,
    open_run, print_config, resolve_config, run_app,
)

app = command_app("rl-cache", "Shared KV-cache block store.", no_args_is_help=True)


class Backend(str, Enum):
    memory = "memory"
    mooncake = "mooncake"


class Tier(str, Enum):
    ram = "ram"
    disk = "disk"


ConnectOpt = Annotated[Optional[str], typer.Option(help="Store endpoint (tcp://host:port) [default: the run "
                                                   "directory's registry].")]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds to wait for the answer.")]


@app.command("serve", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-cache")
def serve(
    ctx: typer.Context,
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    backend: Annotated[Optional[Backend], typer.Option(help="Store backend [default: cache.backend.name].",
                                                       show_default=False)] = None,
    host: Annotated[Optional[str], typer.Option(help="Interface to bind [default: cache.host].")] = None,
    port: Annotated[Optional[int], typer.Option(help="TCP port; 0 picks a free one.")] = None,
    capacity_mb: Annotated[Optional[int], typer.Option(help="Byte capacity in MiB (RAM tier, or the "
                                                       "Mooncake segment).")] = None,
    disk_dir: Annotated[Optional[Path], typer.Option(help="Disk tier under the RAM tier (memory backend) "
                                                     "[default: cache.backend.disk_dir, none].")] = None,
    disk_capacity_mb: Annotated[Optional[int], typer.Option(help="Byte capacity of the disk tier in MiB.")] = None,
    mooncake_master: Annotated[Optional[str], typer.Option(help="host:port of a running mooncake_master "
                                                           "[default: start one].")] = None,
    print_config_: PrintConfigOpt = False,
    json_: JsonConfigOpt = False,
) -> None:
    """Run the block store (registers in the run directory when a recipe or --run-dir is given)."""
    if disk_capacity_mb is not None and disk_capacity_mb < 1:  # the disk tier is off without --disk-dir
        from rlcli.errors import ConfigError

        raise ConfigError(f"--disk-capacity-mb must be >= 1, got {disk_capacity_mb} (for no disk tier, leave out "
                          "--disk-dir)")
    if backend is None and (disk_dir is not None or disk_capacity_mb is not None or mooncake_master):
        backend = Backend.mooncake if mooncake_master else Backend.memory
    cfg = resolve_config(ctx, config, {"run_dir": str(run_dir) if run_dir else None, "cache.host": host,
                                       "cache.port": port, "cache.capacity_mb": capacity_mb,
                                       "cache.backend.name": backend.value if backend else None,
                                       "cache.backend.disk_dir": str(disk_dir) if disk_dir else None,
                                       "cache.backend.disk_capacity_mb": disk_capacity_mb,
                                       "cache.backend.master": mooncake_master})
    if print_config_:
        return print_config(cfg, json_)
    run = open_run(cfg, "cache") if (config or run_dir) else None
    from rlcli.cache.server import serve as serve_forever
    from rlcli.transport.zmq import name_bind_keys

    name_bind_keys("--host or cache.host", "--port or cache.port")

    raise typer.Exit(serve_forever(cfg, run))


def _check(connect: Optional[str], timeout: float) -> None:
    """--connect and --timeout, before the store is looked for."""
    from rlcli.transport.zmq import check_endpoint, check_timeout

    check_timeout(timeout)
    if connect is not None:
        check_endpoint(connect, "--connect")


def _client(run_dir, connect, timeout):
    from rlcli.cache.client import CacheClient, find_endpoint

    _check(connect, timeout)
    return CacheClient(find_endpoint(run_dir, connect), timeout)


@app.command("stats")
@handle_errors("rl-cache")
def stats(run_dir: RunDirOpt = None, connect: ConnectOpt = None, timeout: TimeoutOpt = 5.0,
          json_: JsonOpt = False) -> None:
    """Print the store's counters: hit rate, blocks and bytes per tier, evictions, rejected and corrupt blocks."""
    from rlcli.cache.client import query_stats

    _check(connect, timeout)
    result = query_stats(run_dir, connect, timeout)
    if json_:
        emit_json(result)
    else:
        for key, value in result.items():
            print(f"{key:>18}  {value:.3f}" if isinstance(value, float) else f"{key:>18}  {value}")


@app.command("ls")
@handle_errors("rl-cache")
def ls(run_dir: RunDirOpt = None, connect: ConnectOpt = None, timeout: TimeoutOpt = 5.0,
       limit: Annotated[int, typer.Option(help="Most blocks to list, most recently used first.")] = 100,
       json_: JsonOpt = False) -> None:
    """List stored blocks: key, tier, bytes, model fingerprint, dtype and shape."""
    if limit < 1:  # 0 would list nothing, not everything
        from rlcli.errors import ConfigError

        raise ConfigError(f"--limit must be >= 1, got {limit}")
    client = _client(run_dir, connect, timeout)
    try:
        entries = client.ls(limit)
    finally:
        client.close()
    for e in entries:
        if json_:
            emit_json(e)
        else:
            meta = e["meta"] or {}
            print(f"{e['key']}  {e['tier']:>8}  {e['nbytes']:>10}  {meta.get('fingerprint', '-')}  "
                  f"{meta.get('dtype', '-')}  {meta.get('shape', '-')}")


@app.command("prune")
@handle_errors("rl-cache")
def prune(run_dir: RunDirOpt = None, connect: ConnectOpt = None, timeout: TimeoutOpt = 30.0,
          fingerprint: Annotated[str, typer.Option(help="Remove only blocks of this model fingerprint.")] = "",
          tier: Annotated[Optional[Tier], typer.Option(help="Remove only from this tier [default: every "
                                                       "tier].", show_default=False)] = None,
          json_: JsonOpt = False) -> None:
    """Remove blocks (all, or one model's, or one tier's); prints how many and how many bytes."""
    client = _client(run_dir, connect, timeout)
    try:
        result = client.prune(fingerprint, tier.value if tier else "")
    finally:
        client.close()
    if json_:
        emit_json(result)
    else:
        print(f"removed {result['num_removed']} blocks ({result['bytes_freed']} bytes)")


def main() -> None:
    run_app(app, "rl-cache")


if __name__ == "__main__":
    main()
