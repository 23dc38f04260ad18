import importlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import pytest
import typer

from rlcli.cli import completions

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "completions"
BASH, FISH, ZSH = SCRIPTS / "rlcli.bash", SCRIPTS / "rlcli.fish", SCRIPTS / "_rlcli"
FILES = {"a.toml", "b.gguf", "sub"}


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A directory holding two files and a subdirectory, for path completion."""
    (tmp_path / "a.toml").touch()
    (tmp_path / "b.gguf").touch()
    (tmp_path / "sub").mkdir()
    return tmp_path


def run_shell(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run a shell in its own session; on timeout end its whole group (zpty starts a grandchild)."""
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_committed_files_are_current():
    for name, text in completions.render().items():
        assert (SCRIPTS / name).read_text() == text, (
            f"completions/{name} is stale: run `python -m rlcli.cli.completions` and commit the result")


def test_check_names_the_stale_file(tmp_path, capsys):
    assert completions.main(["--check", "--out-dir", str(tmp_path)]) == 1
    assert "rlcli.bash is stale" in capsys.readouterr().err
    assert completions.main(["--out-dir", str(tmp_path)]) == 0
    (tmp_path / "_rlcli").write_text("#compdef rl-train\n")
    assert completions.main(["--check", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "_rlcli is stale" in err and len(err.strip().splitlines()) == 1


def test_check_from_the_shell():
    proc = subprocess.run([sys.executable, "-m", "rlcli.cli.completions", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _click_tree():
    """(program, subcommand or "", long option names, argument count) read straight from the click objects."""
    for program, module, _ in completions.PROGRAMS:
        cmd = typer.main.get_command(importlib.import_module(module).app)
        for sub_name, sub in [("", cmd), *getattr(cmd, "commands", {}).items()]:
            params = sub.get_params(sub.context_class(sub, info_name=sub_name or program))
            longs = [n for p in params if p.param_type_name == "option"
                     for n in (*p.opts, *p.secondary_opts) if n.startswith("--")]
            yield program, sub_name, longs


def test_every_subcommand_and_long_option_is_in_every_script():
    bash, zsh, fish = BASH.read_text(), ZSH.read_text(), FISH.read_text()
    for program, sub, longs in _click_tree():
        assert f"complete -F _rlcli_{program.replace('-', '_')} {program}" in bash
        assert program in zsh.splitlines()[0].split() and f"complete -c {program} " in fish
        if sub:
            assert f"        {sub})" in bash, (program, sub)
            assert f"    '{sub}:" in zsh, (program, sub)
            assert f"-n __fish_use_subcommand -a {sub} -d " in fish, (program, sub)
        for name in longs:
            assert f" {name} " in f" {bash.replace(chr(34), ' ')} ", (program, sub, name)
            assert f"{name}[" in zsh or f"{name}=[" in zsh, (program, sub, name)
            assert f" -l {name[2:]} " in fish, (program, sub, name)


def test_default_subcommands_match_main(monkeypatch):
    for program, module_name, default in completions.PROGRAMS:
        module = importlib.import_module(module_name)
        if not hasattr(module, "main_with_default"):
            assert default is None, program
            continue
        seen = []
        monkeypatch.setattr(module, "main_with_default", lambda app, name, prog: seen.append((name, prog)))
        module.main()
        assert seen == [(default, program)]


def test_reader_sees_paths_flags_and_repeats():
    app = typer.Typer()

    @app.command()
    def cmd(
        items: Annotated[Optional[list[str]], typer.Argument(help="Items.")] = None,
        recipe: Annotated[Optional[Path], typer.Option("--recipe", "-r", help="A file.\n\nMore text.")] = None,
        out: Annotated[Optional[Path], typer.Option(file_okay=False, help="A directory.")] = None,
        tag: Annotated[Optional[list[str]], typer.Option(help="Repeatable.")] = None,
        plot: Annotated[bool, typer.Option("--plot/--no-plot")] = True,
    ) -> None:
        """First paragraph
        of the help.

        Second paragraph."""

    got = completions._read_command("prog", "prog", typer.main.get_command(app), set())
    assert got.help == "First paragraph of the help."
    options = {o.names[0]: o for o in got.options}
    assert options["--recipe"].names == ("--recipe", "-r") and options["--recipe"].help == "A file."
    assert (options["--recipe"].path, options["--out"].path, options["--tag"].path) == ("file", "dir", None)
    assert options["--tag"].repeatable and options["--tag"].takes_value
    assert options["--plot"].negations == ("--no-plot",) and not options["--plot"].takes_value
    assert [(a.name, a.path, a.variadic) for a in got.arguments] == [("items", None, True)]


# ---------------------------------------------------------------------------------------------------------
# The scripts, driven by the shells themselves.

_BASH_DRIVER = r'''
source "$1"; shift
COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 ))
spec=$(complete -p "$1"); fn=${spec#*-F }; fn=${fn%% *}
"$fn"
printf '%s\n' "${COMPREPLY[@]}"
'''


def bash_complete(words: list[str], cwd: Path) -> set[str]:
    """COMPREPLY for a command line whose last word is the one being completed."""
    proc = run_shell(["bash", "--norc", "--noprofile", "-c", _BASH_DRIVER, "bash", str(BASH), *words], cwd)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return {line for line in proc.stdout.splitlines() if line}


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize("line, expected", [
    ("rl-train --co", {"--config"}),
    ("rl-train ", {"run", "sft", "convert"}),
    ("rl-train -", {"--config", "-c", "--run-dir", "--steps", "--lr", "--micro-batch-tokens", "--threads",
                    "--print-config", "--help"}),
    ("rl-train --config ", FILES),
    ("rl-train -c a.toml --st", {"--steps"}),
    ("rl-train sft --o", {"--out"}),
    ("rl-train sft --lr ", set()),
    ("rl-train convert ", FILES),
    ("rl-infer g", {"generate"}),
    ("rl-infer --id 3 --run-dir ", FILES),
    ("rl-infer generate --model s", {"sub"}),
    ("rl-infer generate ", set()),
    ("rl-sync --keep-weights 2 --p", {"--print-config"}),
    ("rl-cache stats --", {"--run-dir", "--connect", "--timeout", "--json", "--help"}),
    ("rl-cache serve --config a.toml --port ", set()),
    ("rl-orchestrate u", {"up"}),
    ("rl-orchestrate ", {"run", "up", "status"}),
    ("rl-orchestrate up ", FILES),
    ("rl-orchestrate up a.toml --n", {"--no-plot", "--num-infer"}),
    ("rl-orchestrate status ", FILES),
    ("rl-orchestrate nonsense --", set()),
])
def test_bash(line, expected, workdir):
    assert bash_complete(line.split(" "), workdir) == expected


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_equals_form(workdir):
    # readline splits `--config=a` into the words --config, =, a
    assert bash_complete(["rl-train", "--config", "="], workdir) == FILES
    assert bash_complete(["rl-cache", "serve", "--config", "=", "a"], workdir) == {"a.toml"}


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
@pytest.mark.parametrize("line, expected", [
    ("rl-orchestrate ", {"run", "up", "status"}),
    ("rl-orchestrate up ", {"a.toml", "b.gguf", "sub/"}),
    ("rl-orchestrate up a.toml --n", {"--no-plot", "--num-infer"}),
    ("rl-train --co", {"--config"}),
    ("rl-train --config ", {"a.toml", "b.gguf", "sub/"}),
    ("rl-train --config a.toml --st", {"--steps"}),
    ("rl-train sft -", {"-c", "-o", "--out", "--config", "--steps", "--lr", "--threads", "--print-config",
                        "--help"}),
    ("rl-cache stats --", {"--run-dir", "--connect", "--timeout", "--json", "--help"}),
    ("rl-infer generate --max-tokens ", set()),
    ("rl-sync --k", {"--keep-weights"}),
])
def test_fish(line, expected, workdir):
    proc = run_shell(["fish", "--no-config", "-c", f"source {FISH}; complete -C $argv[1]", line], workdir)
    assert proc.returncode in (0, 1) and not proc.stderr, proc.stderr
    assert {row.split("\t")[0] for row in proc.stdout.splitlines()} == expected


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_descriptions(workdir):
    proc = run_shell(["fish", "--no-config", "-c", f"source {FISH}; complete -C 'rl-orchestrate '"], workdir)
    rows = dict(row.split("\t", 1) for row in proc.stdout.splitlines())
    assert rows["up"].startswith("Launch every process of a recipe")


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_syntax():
    proc = run_shell(["zsh", "-n", str(ZSH)], REPO)
    assert proc.returncode == 0, proc.stderr


# zpty runs an interactive zsh with compinit and the script on $fpath; a compadd wrapper prints every match
# and comppostfuncs prints a sentinel once the completion widget is done.
_ZSH_RC = r'''
fpath=({scripts} $fpath)
autoload -Uz compinit && compinit -u -d {dump}
compadd() {{
  if [[ ${{@[1,(i)(-|--)]}} == *-(O|A|D)\ * ]]; then builtin compadd "$@"; return $?; fi
  local -a hits; builtin compadd -A hits "$@"; local ret=$? h
  for h in $hits; do print -r -- "MATCH:$h"; done
  return $ret
}}
comppostfuncs=(__done)
__done() {{ print -r -- __DONE__ }}
bindkey '^I' complete-word
'''

_ZSH_DRIVER = r'''
zmodload zsh/zpty || exit 3
zpty z zsh -f -i
zpty -w z "source ${(q)1}"
zpty -w -n z "$2"$'\t'
local line
while zpty -r z line; do
  [[ $line == *__DONE__* ]] && break
  [[ $line == *MATCH:* ]] && print -r -- "${${line##*MATCH:}%$'\r'}"
done
zpty -d z
'''


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
@pytest.mark.parametrize("line, expected", [
    ("rl-train --co", {"--config"}),
    ("rl-train ", {"run", "sft", "convert"}),
    ("rl-train --config ", FILES),
    ("rl-train --config=", FILES),
    ("rl-train -c a.toml --", {"--run-dir", "--steps", "--lr", "--micro-batch-tokens", "--threads",
                               "--print-config", "--help"}),
    ("rl-orchestrate u", {"up"}),
    ("rl-orchestrate up ", FILES),
    ("rl-orchestrate up a.toml --n", {"--no-plot", "--num-infer"}),
    ("rl-cache stats --", {"--run-dir", "--connect", "--timeout", "--json", "--help"}),
    ("rl-sync --k", {"--keep-weights"}),
])
def test_zsh(line, expected, workdir, tmp_path_factory):
    rc = tmp_path_factory.mktemp("zsh") / "rc.zsh"
    rc.write_text(_ZSH_RC.format(scripts=SCRIPTS, dump=rc.with_name("zcompdump")))
    proc = run_shell(["zsh", "-f", "-c", _ZSH_DRIVER, "zsh", str(rc), line], workdir)
    if proc.returncode == 3:
        pytest.skip("zsh/zpty is not available")
    assert {row for row in proc.stdout.splitlines() if row} == expected
