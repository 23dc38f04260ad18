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
