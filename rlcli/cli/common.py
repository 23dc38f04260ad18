"""Options and helpers every command shares (config resolution, run directory, output)."""

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}
"""context_settings of a command that takes dotted overrides (--section.key VALUE)."""

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML recipe (see recipes/).",
                                                   show_default=False)]
RunDirOpt = Annotated[Optional[Path], typer.Option("--run-dir", help="Run directory shared by all processes "
                                                   "[default: runs/<recipe name>].", show_default=False)]
PrintConfigOpt = Annotated[bool, typer.Option("--print-config", help="Print the resolved recipe as TOML and exit.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Write JSON lines to stdout.")]

OVERRIDES_HELP = "Any recipe key can be overridden as --section.key VALUE (e.g. --train.optim.lr 3e-6)."


def resolve_config(ctx: typer.Context, config: Optional[Path], flags: dict[str, Any]):
    """The validated recipe: file, then flags (None = not given), then dotted overrides in ``ctx.args``."""
    from rlcli.config import load_recipe
    from rlcli.config.load import parse_overrides

    return load_recipe(config, flags, parse_overrides(ctx.args))


def print_config(cfg) -> None:
    from rlcli.config import dump_toml, to_dict

    sys.stdout.write(dump_toml(to_dict(cfg)))


def open_run(cfg, command: str):
    """Create or join the run directory, check it belongs to this recipe, record the config."""
    from rlcli.config import dump_toml, to_dict
    from rlcli.transport.rundir import RunDir

    if command in ("train", "orchestrate", "up"):
        from rlcli.models.config import ModelArgs

        ModelArgs.from_dir(cfg.model.path)  # fail early, in one line, on a missing model directory
    run = RunDir(cfg.run_dir)
    model = to_dict(cfg.model)
    model["path"] = os.path.abspath(model["path"]) if model["path"] else ""
    run.claim(cfg.name, {"model": model, "env": to_dict(cfg.env)})
    run.write_config(command, dump_toml(to_dict(cfg)))
    return run


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def main_with_default(app: typer.Typer, default: str, prog: str) -> None:
    """Run ``app`` (a group of subcommands) with ``default`` as the subcommand when none is named,
    so ``rl-train --config x.toml`` means ``rl-train run --config x.toml``."""
    argv = sys.argv[1:]
    names = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
    if not argv or (argv[0] not in names and argv[0] not in ("--help", "-h", "--version")):
        argv = [default, *argv]
    app(args=argv, prog_name=prog)
