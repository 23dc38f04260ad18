"""docs/cli.md: the command-line reference, generated from the five typer apps.

The Markdown is typer's own (``typer.cli.get_docs_for_click``, what ``typer MODULE utils docs``
writes), one section per program, so every option, default and help line in it is the one the
command has. ``tests/test_reference.py`` fails when the committed file is stale.

    python -m rlcli.cli.reference > docs/cli.md   # or: python -m rlcli.cli.reference --out docs/cli.md
    python -m rlcli.cli.reference --check         # exit 1 when docs/cli.md is stale
"""

import argparse
import importlib
import sys
from pathlib import Path
from typing import Optional

from rlcli.transport.atomic import atomic_write_bytes

OUT = Path(__file__).resolve().parents[2] / "docs" / "cli.md"

MODULES = {"rl-infer": "rlcli.cli.infer", "rl-train": "rlcli.cli.train", "rl-sync": "rlcli.cli.sync",
           "rl-cache": "rlcli.cli.cache", "rl-orchestrate": "rlcli.cli.orchestrate"}

DEFAULTS = {"rl-infer": "serve", "rl-train": "run", "rl-sync": "run"}
"""The subcommand a program runs when the command line names none (``run_app``'s ``default``)."""

GENERATOR = "python -m rlcli.cli.reference > docs/cli.md"


def render() -> str:
    import typer
    from typer.cli import get_docs_for_click

    parts = ["# CLI reference\n",
             f"Generated from the typer apps by `{GENERATOR}`; do not edit by hand. The user guide, with "
             "examples, is in [guide/](guide/). Every command that takes `--config` also takes any recipe key "
             "as a dotted override, `--section.key VALUE`.\n"]
    for prog, module in MODULES.items():
        command = typer.main.get_command(importlib.import_module(module).app)
        text = get_docs_for_click(obj=command, ctx=typer.Context(command), name=prog).strip()
        if prog in DEFAULTS:
            title, _, rest = text.partition("\n")
            text = f"{title}\n\nWith no subcommand, `{prog}` runs `{prog} {DEFAULTS[prog]}`.\n{rest}"
        parts.append("#" + text.replace("\n#", "\n##"))  # one H1 for the page; programs are H2
    return "\n".join(parts).rstrip("\n") + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcli.cli.reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {OUT.name} is stale")
    parser.add_argument("--out", type=Path, help="write to this file instead of stdout")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run `{GENERATOR}`", file=sys.stderr)
            return 1
    elif args.out:
        atomic_write_bytes(args.out, text.encode(), fsync=False)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
