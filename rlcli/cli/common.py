"""Options and helpers every command shares (config resolution, run directory, output)."""

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}
"""context_settings of a command that takes dotted overrides (--section.key VALUE)."""

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML recipe (see recipes/).",
                                                   show_default=False)]


def _run_dir(value: str) -> Path:
    """--run-dir's value as a Path; an empty one is refused. It comes from an unset shell variable
    (``--run-dir "$RUN"``), and as Path("") it would make the working directory the run directory."""
    if not value.strip():
        raise typer.BadParameter("is empty (an unset shell variable?); name the run directory")
    return Path(value)


def _no_words(incomplete: str) -> list:
    """No words of click's: the shell's own file completion, as for a Path option (a parser replaces
    that type, and its completion with it)."""
    return []


RunDirOpt = Annotated[Optional[Path], typer.Option("--run-dir", help="Run directory shared by all processes "
                                                   "[default: runs/<recipe name>].", show_default=False,
                                                   parser=_run_dir, metavar="<path>", autocompletion=_no_words)]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed of the run (default: the recipe's seed).",
                                                show_default=False)]
R3Opt = Annotated[Optional[bool], typer.Option("--r3/--no-r3", help="Routing replay for MoE models: the engine "
                                               "records routes, the trainer replays them (default: the recipe's r3).",
                                               show_default=False)]
BatchInvariantOpt = Annotated[bool, typer.Option(
    "--batch-invariant", help="Engine and trainer give each token the same logprob bits whatever its batch "
    "(model.batch_invariant; both sides must set it).")]
PrintConfigOpt = Annotated[bool, typer.Option("--print-config", help="Print the resolved recipe as TOML and exit.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Write JSON lines to stdout.")]
JsonRunOpt = Annotated[bool, typer.Option("--json", help="JSON on stdout: --print-config as JSON, and one line "
                                          "(exit code, progress) when the process ends.")]
JsonConfigOpt = Annotated[bool, typer.Option("--json", help="With --print-config: the resolved recipe as JSON.")]
JsonAlwaysOpt = Annotated[bool, typer.Option("--json", help="Accepted for uniformity: the output is always JSON.")]


class EngineName(str, Enum):
    native = "native"
    vllm = "vllm"


EngineOpt = Annotated[Optional[EngineName], typer.Option("--engine", help="rl-infer's engine [default: "
                                                         "infer.engine.name].", show_default=False)]

OVERRIDES_HELP = "Any recipe key can be overridden as --section.key VALUE (e.g. --train.optim.lr 3e-6)."


def resolve_config(ctx: typer.Context, config: Optional[Path], flags: dict[str, Any]):
    """The validated recipe: file, then flags (None = not given), then dotted overrides in ``ctx.args``."""
    from rlcli.config import load_recipe
    from rlcli.config.load import parse_overrides

    return load_recipe(config, flags, parse_overrides(ctx.args))


def print_config(cfg, as_json: bool = False) -> None:
    from rlcli.config import dump_toml, to_dict

    if as_json:
        return emit_json(to_dict(cfg))
    sys.stdout.write(dump_toml(to_dict(cfg)))


def finish(run, command: str, code: int, as_json: bool):
    """End a long-running command with ``code``; with --json, rank 0 first writes one line: the run
    directory, the exit code and the command's RUN/progress/<command>.json."""
    if as_json and os.environ.get("RANK", "0") == "0":
        emit_json({"command": command, "run_dir": str(run.root), "exit_code": code,
                   "progress": run.read_progress(command)})
    raise typer.Exit(code)


def open_run(cfg, command: str):
    """Create or join the run directory, check it belongs to this recipe, record the config.

    The claim binds the directory to this recipe's model and environment, so what can refuse the
    recipe is checked first (here the model directory, a built-in environment's env.args and
    rl-train's own loss function, if it names one; a command's own checks before it calls this):
    a refused start leaves no claim that would refuse the corrected one."""
    from rlcli.config import dump_toml, to_dict
    from rlcli.transport.rundir import RunDir

    if command != "cache":  # every other process reads model.path, and the claim below records it
        from rlcli.models.config import ModelArgs

        ModelArgs.from_dir(cfg.model.path)  # fail early, in one line, on a missing model directory
    from rlcli.config.env import BUILTIN_ARGS, builtin_args

    if cfg.env.name in BUILTIN_ARGS:  # the claim records env.args too: a built-in's are checked first
        builtin_args(cfg.env.name, dict(cfg.env.args))
    if command == "train":
        from rlcli.config.train import check_loss_importable

        check_loss_importable(cfg.train.loss)
    run = RunDir(cfg.run_dir)
    model = to_dict(cfg.model)
    model["path"] = os.path.abspath(model["path"]) if model["path"] else ""
    run.claim(cfg.name, {"model": model, "env": to_dict(cfg.env)})
    run.clean_small_temporaries()
    run.write_config(command, dump_toml(to_dict(cfg)))
    if command != "up":  # `up`'s children have their logs; its own lines stay on its terminal
        from rlcli.logging import log_to_file

        # A process started by hand keeps its log in the run too; under a launcher, stderr is that file.
        name, _, instance = command.partition("-")
        log_to_file(run.log_file(name, instance or 0), f"rl-{name}")
    # `up`'s children log for themselves; under torchrun only rank 0 writes metrics.
    if command != "up" and os.environ.get("RANK", "0") == "0":
        from rlcli.transport.sinks import make_sinks

        run.sinks = make_sinks(cfg, run.root, command)
    return run


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


COMPLETE_ARGS = "_TYPER_COMPLETE_ARGS"
"""Environment variable through which typer's zsh and fish scripts pass the command line."""


def command_app(prog: str, help: str, **kwargs) -> typer.Typer:
    """The typer app of command ``prog``: ``-h`` as well as ``--help``, and ``--version``."""
    app = typer.Typer(help=help, add_completion=False, pretty_exceptions_enable=False,
                      context_settings={"help_option_names": ["-h", "--help"]}, **kwargs)

    def show_version(value: bool) -> None:
        if value:
            from rlcli import __version__

            typer.echo(f"{prog} {__version__}")
            raise typer.Exit()

    @app.callback()
    def _options(version: Annotated[bool, typer.Option("--version", is_eager=True, callback=show_version,
                                                       help="Print the version and exit.")] = False) -> None:
        pass

    return app


def run_app(app: typer.Typer, prog: str, default: Optional[str] = None) -> None:
    """Run ``app`` as ``prog``. With ``default`` (a subcommand name), a command line that names no
    subcommand runs that one: ``rl-train --config x.toml`` means ``rl-train run --config x.toml``.

    Shell completion is click's own, as typer provides it: the scripts in completions/ call back
    into ``prog`` with ``_<PROG>_COMPLETE=complete_<shell>`` and the words typed so far, and click
    answers from the command tree (subcommands, options, choices, paths). The same default
    subcommand is inserted into those words, so completion and execution see one command line.
    """
    from typer.completion import completion_init

    completion_init()
    argv = sys.argv[1:]
    try:
        from setproctitle import setproctitle

        setproctitle(" ".join([prog, *argv])[:200])  # `ps` and `top` show rl-infer, not python
    except (ImportError, UnicodeError):  # an argument that is not text (a non-UTF-8 path) keeps python's title
        pass
    if default is not None:
        names = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
        if not argv or (argv[0] not in names and argv[0] not in ("--help", "-h", "--version")):
            argv = [default, *argv]
        if os.environ.get(f"_{prog.replace('-', '_').upper()}_COMPLETE"):
            _complete_with_default(names, default)
    try:  # not standalone: click's usage errors come here instead of printing its Usage box
        code = app(args=argv, prog_name=prog, standalone_mode=False)
    except typer.Abort:
        print(f"{prog}: aborted", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:  # click's ClickException (typer vendors click, so matched by its interface)
        if not (callable(getattr(e, "format_message", None)) and isinstance(getattr(e, "exit_code", None), int)):
            raise
        if not e.format_message():  # a group called with no arguments: its help, as click shows it
            e.show()
            sys.exit(e.exit_code)
        ctx = getattr(e, "ctx", None)  # an unknown option, a bad value, a missing argument
        where = ctx.command_path if ctx is not None else prog
        print(f"{prog}: error: {e.format_message()} (see `{where} --help`)", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)  # typer.Exit's code; a command's own return is None


def _complete_with_default(names: set[str], default: str) -> None:
    """Insert ``default`` after the program name in a completion request whose first argument is
    an option or is already complete and names no subcommand. bash passes the words in
    COMP_WORDS/COMP_CWORD; zsh and fish pass the typed line in COMPLETE_ARGS."""

    def needs_default(words: list[str], first_is_complete: bool) -> bool:
        return len(words) >= 2 and words[1] not in names and (words[1].startswith("-") or first_is_complete)

    if "COMP_WORDS" in os.environ:
        words = os.environ["COMP_WORDS"].split()  # typer joins them with newlines
        cword = int(os.environ.get("COMP_CWORD", "1"))
        if needs_default(words, cword >= 2):
            os.environ["COMP_WORDS"] = " ".join([words[0], default, *words[1:]])
            os.environ["COMP_CWORD"] = str(cword + 1)
    line = os.environ.get(COMPLETE_ARGS)
    if line is not None:
        words = line.split()
        if needs_default(words, len(words) > 2 or line.endswith(" ")):
            head, _, rest = line.partition(" ")
            os.environ[COMPLETE_ARGS] = f"{head} {default} {rest}"
