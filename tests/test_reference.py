"""docs/cli.md is what `python -m rlcli.cli.reference` generates from the typer apps today."""

import importlib
import inspect

from rlcli.cli import reference


def test_committed_reference_is_current():
    assert reference.OUT.read_text() == reference.render(), (
        f"docs/cli.md is stale: run `{reference.GENERATOR}` and commit the result")


def test_reference_names_every_command_and_the_default_subcommands():
    text = reference.render()
    for prog, module in reference.MODULES.items():
        app = importlib.import_module(module).app
        for cmd in app.registered_commands:
            assert f"### `{prog} {cmd.name}`" in text
        # DEFAULTS says what each program's main() passes to run_app.
        main = inspect.getsource(importlib.import_module(module).main)
        default = reference.DEFAULTS.get(prog)
        assert (f'run_app(app, "{prog}", "{default}")' if default else f'run_app(app, "{prog}")') in main


def test_check_names_the_stale_file(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(reference, "OUT", tmp_path / "cli.md")
    (tmp_path / "cli.md").write_text("# old\n")
    assert reference.main(["--check"]) == 1
    assert "cli.md is stale" in capsys.readouterr().err
    assert reference.main(["--out", str(tmp_path / "cli.md")]) == 0 and reference.main(["--check"]) == 0


def _command_lines(text: str):
    """Each `rl-*` invocation in the bash blocks of a Markdown file (pipes split, comments dropped)."""
    import re
    import shlex

    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "rl-" not in line:  # e.g. a curl line whose quoted JSON spans lines
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;()")
            lexer.whitespace_split = True  # comments (#) are dropped by the lexer
            words: list[str] = []
            for token in [*lexer, "|"]:
                if token in ("|", "||", "&&", ";", "(", ")"):
                    if words and words[0] in reference.MODULES:
                        yield words
                    words = []
                else:
                    words.append(token)


def test_guide_examples_use_real_options():
    """Every option an example in docs/guide/ or README passes exists on that command (dotted
    recipe overrides excepted), so the guide cannot drift from the CLI unnoticed."""
    import typer

    docs = sorted((reference.OUT.parent / "guide").glob("*.md"))
    assert {p.stem for p in docs} == set(reference.MODULES)
    checked = 0
    for path in [*docs, reference.OUT.parent.parent / "README.md"]:
        for words in _command_lines(path.read_text()):
            prog, rest = words[0], words[1:]
            group = typer.main.get_command(importlib.import_module(reference.MODULES[prog]).app)
            name = rest[0] if rest and rest[0] in group.commands else reference.DEFAULTS.get(prog)
            assert name, f"{path.name}: {' '.join(words)} names no subcommand"
            opts = {o for p in group.commands[name].params for o in (*p.opts, *p.secondary_opts)}
            for word in rest:
                if word.startswith("-") and "." not in word.split("=")[0]:
                    assert word.split("=")[0] in opts, f"{path.name}: {prog} {name} has no option {word}"
            checked += 1
    assert checked > 40


def test_print_config_examples_print_what_they_show():
    """A guide example `rl-X ... --print-config --json | jq -c .a.b` followed by `# {...}` shows
    what that command prints today (run here, the jq path taken in Python)."""
    import json
    import re
    import shlex
    import subprocess
    import sys

    root = reference.OUT.parent.parent
    pattern = re.compile(r"^(rl-[\w-]+ .*--print-config --json) \| jq -c (\.[\w.]+)\n# (\{.*\})$", re.M)
    checked = 0
    for path in sorted((root / "docs" / "guide").glob("*.md")):
        for command, jq_path, shown in pattern.findall(path.read_text()):
            words = shlex.split(command)
            code = (f"import sys; sys.argv = {words!r}; "
                    f"from {reference.MODULES[words[0]]} import main; main()")
            out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                                 timeout=120)
            assert out.returncode == 0, out.stderr
            value = json.loads(out.stdout)
            for key in jq_path.strip(".").split("."):
                value = value[key]
            assert value == json.loads(shown), f"{path.name}: `{command} | jq -c {jq_path}` prints {json.dumps(value)}"
            checked += 1
    assert checked >= 2
