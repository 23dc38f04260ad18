"""Shell completions for the five commands, generated from their typer/click trees.

The scripts are static: pressing TAB never starts Python (an interpreter round trip per key press would
make completion feel sluggish), so completion is instant. The price is that they must be regenerated
whenever a command, option or help line changes; ``tests/test_completions.py`` fails while the committed
files are stale.

    python -m rlcli.cli.completions           # rewrite completions/rlcli.bash, _rlcli, rlcli.fish
    python -m rlcli.cli.completions --check   # exit 1 naming the first stale file

Dotted recipe overrides (``--section.key VALUE``) are open-ended and are not completed.
"""

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, get_args, get_origin

import typer

OUT_DIR = Path(__file__).resolve().parents[2] / "completions"

PROGRAMS = (
    # (program, module with the typer `app`, subcommand that runs when none is named)
    ("rl-infer", "rlcli.cli.infer", "serve"),
    ("rl-train", "rlcli.cli.train", "run"),
    ("rl-sync", "rlcli.cli.sync", None),
    ("rl-cache", "rlcli.cli.cache", None),
    ("rl-orchestrate", "rlcli.cli.orchestrate", None),
)
"""The default subcommands mirror each module's ``main_with_default(app, DEFAULT, ...)`` call."""

PATH_HINTS = {("rl-train", "convert", "source"): "file"}
"""Parameters typed ``str`` that usually name a file (a .gguf, or a package name)."""

GENERATOR = "python -m rlcli.cli.completions"


@dataclass(frozen=True)
class Option:
    names: tuple[str, ...]
    """Long and short spellings, e.g. ('--config', '-c'); for a --x/--no-x flag the positive ones."""
    negations: tuple[str, ...]
    """The --no-x spellings of a boolean flag (empty otherwise)."""
    help: str
    takes_value: bool
    path: Optional[str]
    """'file' or 'dir' when the value is a path, None otherwise."""
    repeatable: bool

    @property
    def all_names(self) -> tuple[str, ...]:
        return self.names + self.negations


@dataclass(frozen=True)
class Argument:
    name: str
    help: str
    path: Optional[str]
    variadic: bool


@dataclass(frozen=True)
class Command:
    name: str
    """The program (rl-train) for a top-level command, the subcommand name (sft) otherwise."""
    help: str
    options: tuple[Option, ...]
    arguments: tuple[Argument, ...]
    subcommands: tuple["Command", ...] = ()
    default: Optional[str] = None
    """Subcommand that runs when the first word names none (rl-infer, rl-train)."""


# ---------------------------------------------------------------------------------------------------------
# Reading the click tree. Typer >= 0.2x ships its own click fork (parameters carry a `type_descriptor`);
# older typer builds on click (parameters carry a click `type`). Both expose opts/secondary_opts/is_flag.


def _first_paragraph(text: Optional[str]) -> str:
    paragraph = (text or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def _path_kind(param) -> Optional[str]:
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None:
        annotation = descriptor.annotation
        if get_origin(annotation) is list:
            annotation = get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, Path)):
            return None
        info = descriptor.parameter_info
        file_okay, dir_okay = getattr(info, "file_okay", True), getattr(info, "dir_okay", True)
    else:
        click_type = param.type
        if getattr(click_type, "name", None) == "filename":
            return "file"
        if getattr(click_type, "name", None) != "path":
            return None
        file_okay, dir_okay = click_type.file_okay, click_type.dir_okay
    return "dir" if dir_okay and not file_okay else "file"


def _read_command(program: str, name: str, cmd, hinted: set, default: Optional[str] = None) -> Command:
    """``hinted`` collects the PATH_HINTS keys that matched a parameter."""
    ctx = cmd.context_class(cmd, info_name=name)
    options, arguments = [], []
    for param in cmd.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        path = _path_kind(param)
        key = (program, name, param.name)
        if key in PATH_HINTS:
            path = path or PATH_HINTS[key]
            hinted.add(key)
        if param.param_type_name == "argument":
            arguments.append(Argument(param.name, _first_paragraph(param.help), path, param.nargs == -1))
        else:
            is_flag = bool(getattr(param, "is_flag", False) or getattr(param, "count", False))
            options.append(Option(tuple(param.opts), tuple(param.secondary_opts), _first_paragraph(param.help),
                                  not is_flag, path, bool(param.multiple)))
    subcommands = ()
    if getattr(cmd, "commands", None):
        subcommands = tuple(_read_command(program, sub_name, sub, hinted) for sub_name, sub in cmd.commands.items()
                            if not sub.hidden)
        if default is not None and default not in {sub.name for sub in subcommands}:
            raise ValueError(f"{program}: default subcommand {default!r} is not one of its subcommands")
    help_text = cmd.help if subcommands or name == program else (cmd.short_help or cmd.help)
    return Command(name, _first_paragraph(help_text), tuple(options), tuple(arguments), subcommands, default)


def read_programs() -> list[Command]:
    """The five commands as plain data, in PROGRAMS order; each subcommand in registration order."""
    programs, hinted = [], set()
    for program, module, default in PROGRAMS:
        cmd = typer.main.get_command(importlib.import_module(module).app)
        programs.append(_read_command(program, program, cmd, hinted, default))
    missing = set(PATH_HINTS) - hinted
    if missing:
        raise ValueError(f"PATH_HINTS names parameters that no longer exist: {sorted(missing)}; update it")
    return programs


def _leaves(program: Command) -> list[tuple[str, Command]]:
    """(subcommand name or "" for the program itself, command) for every level that takes options."""
    return [("", program)] + [(sub.name, sub) for sub in program.subcommands]


def _ident(program: str) -> str:
    return program.replace("-", "_")


# ---------------------------------------------------------------------------------------------------------
# bash: one generic completer, and per program a "spec" function that describes a subcommand.

_BASH_DRIVER = r'''# _rlcli_complete SPEC SUBCOMMANDS DEFAULT completes the current word of an rl-* command line.
# SPEC SUB sets opts (every option), vopts (options taking a value), fopts / dopts (options whose value is a
# file / directory) and args (one of file, dir, word per positional; a trailing * repeats the last one)
# for subcommand SUB ("" is the program itself). DEFAULT runs when the first word names no subcommand.
_rlcli_complete() {
    local spec=$1 subs=$2 default=$3
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
    local opts="" vopts="" fopts="" dopts="" args="" sub="" start=1 i w opt="" npos=0 dashdash=""
    COMPREPLY=()
    if [[ -n $subs && -n $default ]]; then
        if (( COMP_CWORD > 1 )) && [[ " $subs " == *" ${COMP_WORDS[1]} "* ]]; then
            sub=${COMP_WORDS[1]}; start=2
        elif (( COMP_CWORD == 1 )) && [[ $cur != -* ]]; then
            COMPREPLY=($(compgen -W "$subs" -- "$cur")); return 0
        else
            sub=$default
        fi
    elif [[ -n $subs ]]; then
        $spec ""
        for ((i = 1; i < COMP_CWORD; i++)); do
            w=${COMP_WORDS[i]}
            if [[ " $subs " == *" $w "* ]]; then sub=$w; start=$((i + 1)); break; fi
            [[ $w == -* ]] || return 0
            [[ " $vopts " == *" $w "* ]] && i=$((i + 1))
        done
        if [[ -z $sub ]]; then
            if [[ $cur == -* ]]; then COMPREPLY=($(compgen -W "$opts" -- "$cur"))
            else COMPREPLY=($(compgen -W "$subs" -- "$cur")); fi
            return 0
        fi
    fi
    opts="" vopts="" fopts="" dopts="" args=""
    $spec "$sub"
    for ((i = start; i < COMP_CWORD; i++)); do
        w=${COMP_WORDS[i]}
        if [[ -n $dashdash || $w != -* ]]; then npos=$((npos + 1))
        elif [[ $w == -- ]]; then dashdash=1
        elif [[ " $vopts " == *" $w "* ]]; then
            [[ ${COMP_WORDS[i+1]} == = ]] && i=$((i + 1))
            i=$((i + 1))
        fi
    done
    # `--opt=value` reaches us as the words --opt, =, value.
    if [[ $cur == = && " $vopts " == *" $prev "* ]]; then opt=$prev; cur=""
    elif [[ $prev == = ]] && (( COMP_CWORD > 2 )); then opt=${COMP_WORDS[COMP_CWORD-2]}
    elif [[ -z $dashdash ]] && (( COMP_CWORD > start )); then opt=$prev; fi
    if [[ -n $opt && " $vopts " == *" $opt "* ]]; then
        if [[ " $fopts " == *" $opt "* ]]; then _rlcli_paths -f "$cur"
        elif [[ " $dopts " == *" $opt "* ]]; then _rlcli_paths -d "$cur"; fi
        return 0
    fi
    if [[ -z $dashdash && $cur == -* ]]; then COMPREPLY=($(compgen -W "$opts" -- "$cur")); return 0; fi
    local kinds=($args) kind=""
    if (( npos < ${#kinds[@]} )); then kind=${kinds[npos]}
    elif (( ${#kinds[@]} )) && [[ ${kinds[${#kinds[@]}-1]} == *'*' ]]; then kind=${kinds[${#kinds[@]}-1]}; fi
    case ${kind%'*'} in
        file) _rlcli_paths -f "$cur" ;;
        dir) _rlcli_paths -d "$cur" ;;
        word) ;;
        *) [[ -z $dashdash ]] && COMPREPLY=($(compgen -W "$opts" -- "$cur")) ;;
    esac
    return 0
}

# _rlcli_paths -f|-d PREFIX: files (directories included) or directories only.
_rlcli_paths() {
    compopt -o filenames 2>/dev/null
    local IFS=$'\n'
    COMPREPLY=($(compgen "$1" -- "$2"))
}
'''


def _bash_spec_case(sub: str, cmd: Command) -> list[str]:
    def names(options) -> str:
        return " ".join(name for option in options for name in option.all_names)

    args = [arg.path or "word" for arg in cmd.arguments]
    if cmd.arguments and cmd.arguments[-1].variadic:
        args[-1] += "*"
    fields = [
        ("opts", names(cmd.options)),
        ("vopts", names(o for o in cmd.options if o.takes_value)),
        ("fopts", names(o for o in cmd.options if o.takes_value and o.path == "file")),
        ("dopts", names(o for o in cmd.options if o.takes_value and o.path == "dir")),
        ("args", " ".join(args)),
    ]
    label = sub or '""'
    lines = [f"        {label})"]
    lines += [f'            {key}="{value}"' for key, value in fields if value]
    lines.append("            ;;")
    return lines


def bash_script(programs: list[Command]) -> str:
    out = [
        "# bash completion for rl-infer, rl-train, rl-sync, rl-cache and rl-orchestrate.",
        f"# Generated by `{GENERATOR}` from the commands themselves; do not edit by hand.",
        "# Install: add `source /path/to/rlcli/completions/rlcli.bash` to ~/.bashrc.",
        "",
        _BASH_DRIVER,
    ]
    for program in programs:
        ident = _ident(program.name)
        out.append(f"_rlcli_{ident}_spec() {{")
        out.append("    case $1 in")
        for sub, cmd in _leaves(program):
            out += _bash_spec_case(sub, cmd)
        out.append("    esac")
        out.append("}")
        subs = " ".join(sub.name for sub in program.subcommands)
        out.append(f'_rlcli_{ident}() {{ _rlcli_complete _rlcli_{ident}_spec "{subs}" "{program.default or ""}"; }}')
        out.append(f"complete -F _rlcli_{ident} {program.name}")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# zsh: one _arguments call per subcommand; groups dispatch on the first word.


def _zq(text: str) -> str:
    """Single-quote for zsh."""
    return "'" + text.replace("'", "'\\''") + "'"


def _zdesc(text: str) -> str:
    """Text inside an _arguments [description]."""
    return text.replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]")


def _zmsg(text: str) -> str:
    """Text in the message field of an _arguments spec (colons end the field)."""
    return text.replace("\\", "\\\\").replace(":", "\\:")


def _zaction(path: Optional[str]) -> str:
    return {"file": "_files", "dir": "_files -/", None: " "}[path]


def _zsh_option_specs(option: Option) -> list[str]:
    specs = []
    exclusive = " ".join(option.all_names)
    for negated, names in ((False, option.names), (True, option.negations)):
        for name in names:
            prefix = "*" if option.repeatable else f"({exclusive})"
            help_text = f"Turn off {option.names[0]}: {option.help}" if negated else option.help
            spec = f"{prefix}{name}"
            if option.takes_value:
                spec += "=" if name.startswith("--") else ""
                spec += f"[{_zdesc(help_text)}]:{_zmsg(option.names[0].lstrip('-'))}:{_zaction(option.path)}"
            else:
                spec += f"[{_zdesc(help_text)}]"
            specs.append(_zq(spec))
    return specs


def _zsh_arguments(cmd: Command) -> list[str]:
    specs = [spec for option in cmd.options for spec in _zsh_option_specs(option)]
    for i, arg in enumerate(cmd.arguments, start=1):
        position = "*" if arg.variadic else str(i)
        message = f"{arg.name}: {arg.help}" if arg.help else arg.name
        specs.append(_zq(f"{position}:{_zmsg(message)}:{_zaction(arg.path)}"))
    if not specs:
        return ["  _message 'no arguments'"]
    return ["  _arguments -S \\"] + [f"    {spec} \\" for spec in specs[:-1]] + [f"    {specs[-1]}"]


def zsh_script(programs: list[Command]) -> str:
    names = " ".join(p.name for p in programs)
    out = [
        f"#compdef {names}",
        "# zsh completion for rl-infer, rl-train, rl-sync, rl-cache and rl-orchestrate.",
        f"# Generated by `{GENERATOR}` from the commands themselves; do not edit by hand.",
        "# Install: put this file (named _rlcli) in a directory on $fpath before compinit runs, e.g.",
        "#   mkdir -p ~/.zfunc && cp completions/_rlcli ~/.zfunc/   and in ~/.zshrc: fpath=(~/.zfunc $fpath)",
        "# then `rm -f ~/.zcompdump; compinit`. Sourcing it after compinit works too.",
        "",
    ]
    for program in programs:
        ident = _ident(program.name)
        for sub in program.subcommands:
            out.append(f"__rlcli_{ident}_{_ident(sub.name)}() {{")
            out += _zsh_arguments(sub)
            out += ["}", ""]
        out.append(f"__rlcli_{ident}() {{")
        if not program.subcommands:
            out += _zsh_arguments(program)
            out += ["}", ""]
            continue
        out.append("  local -a subcommands")
        out.append("  subcommands=(")
        out += [f"    {_zq(sub.name + ':' + sub.help)}" for sub in program.subcommands]
        out.append("  )")
        out.append(f"  local fn=__rlcli_{ident}_${{words[2]//-/_}}")
        out.append("  if (( CURRENT > 2 )) && (( $+functions[$fn] )); then")
        out.append("    shift words; (( CURRENT-- ))")
        out.append(f'    curcontext="${{curcontext%:*:*}}:{program.name}-$words[1]:"')
        out.append("    $fn; return")
        out.append("  fi")
        out.append("  if (( CURRENT == 2 )) && [[ $PREFIX != -* ]]; then")
        out.append(f"    _describe -t commands {_zq(program.name + ' subcommand')} subcommands; return")
        out.append("  fi")
        if program.default:
            out.append(f"  # No subcommand named: {program.name} runs {program.default}.")
            out.append(f"  __rlcli_{ident}_{_ident(program.default)}")
        else:
            out += _zsh_arguments(program)
        out += ["}", ""]
    out.append("_rlcli() {")
    out.append("  case $service in")
    out += [f"    ({p.name}) __rlcli_{_ident(p.name)} ;;" for p in programs]
    out.append("  esac")
    out.append("}")
    out.append("")
    out.append("if [[ $zsh_eval_context[-1] == loadautofunc ]]; then")
    out.append('  _rlcli "$@"')
    out.append("else")
    out.append(f"  compdef _rlcli {names}")
    out.append("fi")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------------
# fish: `complete` lines guarded by which subcommand has been seen.


def _fq(text: str) -> str:
    """Single-quote for fish."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_option(program: str, condition: str, option: Option) -> list[str]:
    lines = []
    for negated, names in ((False, option.names), (True, option.negations)):
        if not names:
            continue
        parts = [f"complete -c {program}"]
        if condition:
            parts.append(f"-n {_fq(condition)}")
        parts += [f"-s {n[1:]}" for n in names if not n.startswith("--")]
        parts += [f"-l {n[2:]}" for n in names if n.startswith("--")]
        if option.takes_value:
            parts.append({"file": "-r -F", "dir": "-x -a '(__fish_complete_directories)'", None: "-x"}[option.path])
        help_text = f"Turn off {option.names[0]}: {option.help}" if negated else option.help
        if help_text:
            parts.append(f"-d {_fq(help_text)}")
        lines.append(" ".join(parts))
    return lines


def _fish_arguments(program: str, condition: str, cmd: Command) -> list[str]:
    lines = []
    for kind in sorted({arg.path for arg in cmd.arguments if arg.path}):
        where = f"-n {_fq(condition)} " if condition else ""
        action = "-F" if kind == "file" else "-a '(__fish_complete_directories)'"
        lines.append(f"complete -c {program} {where}{action}")
    return lines


def fish_script(programs: list[Command]) -> str:
    out = [
        "# fish completion for rl-infer, rl-train, rl-sync, rl-cache and rl-orchestrate.",
        f"# Generated by `{GENERATOR}` from the commands themselves; do not edit by hand.",
        "# Install: fish autoloads ~/.config/fish/completions/<command>.fish, so copy this file there once per",
        "# command:  for c in rl-infer rl-train rl-sync rl-cache rl-orchestrate",
        "#               cp completions/rlcli.fish ~/.config/fish/completions/$c.fish; end",
        "# or add `source /path/to/rlcli/completions/rlcli.fish` to ~/.config/fish/config.fish.",
    ]
    for program in programs:
        name = program.name
        out += ["", f"# {name}", f"complete -c {name} -f"]
        if not program.subcommands:
            out += [line for option in program.options for line in _fish_option(name, "", option)]
            out += _fish_arguments(name, "", program)
            continue
        subs = " ".join(sub.name for sub in program.subcommands)
        out += [f"complete -c {name} -n __fish_use_subcommand -a {sub.name} -d {_fq(sub.help)}"
                for sub in program.subcommands]
        if program.default:
            default = next(sub for sub in program.subcommands if sub.name == program.default)
            before = f"not __fish_seen_subcommand_from {subs}"
            out.append(f"# no subcommand named: {name} runs {program.default}")
            out += [line for option in default.options for line in _fish_option(name, before, option)]
            out += _fish_arguments(name, before, default)
        else:
            out += [line for option in program.options
                    for line in _fish_option(name, "__fish_use_subcommand", option)]
        for sub in program.subcommands:
            seen = f"__fish_seen_subcommand_from {sub.name}"
            out += [line for option in sub.options for line in _fish_option(name, seen, option)]
            out += _fish_arguments(name, seen, sub)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------------


def render() -> dict[str, str]:
    """File name under completions/ -> its content."""
    programs = read_programs()
    return {"rlcli.bash": bash_script(programs), "_rlcli": zsh_script(programs), "rlcli.fish": fish_script(programs)}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=GENERATOR, description="Write the shell completion scripts.")
    parser.add_argument("--check", action="store_true", help="Exit 1 if a committed script is out of date.")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="Directory of the scripts.")
    args = parser.parse_args(argv)
    for name, text in render().items():
        path = args.out_dir / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                print(f"{path} is stale; run `{GENERATOR}` and commit the result", file=sys.stderr)
                return 1
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
