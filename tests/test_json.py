"""`--json` on every command that reports something, and what it writes parses with jq."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from procs import write_recipe

BIN = Path(sys.executable).parent
APPS = {"rl-infer": "rlcli.cli.infer", "rl-train": "rlcli.cli.train", "rl-sync": "rlcli.cli.sync",
        "rl-cache": "rlcli.cli.cache", "rl-orchestrate": "rlcli.cli.orchestrate"}
WITHOUT_JSON: set[str] = set()  # every command reports with --json (rl-orchestrate status too, since #10)

needs_jq = pytest.mark.skipif(not shutil.which("jq"), reason="jq is not installed")


def commands():
    """(program subcommand, click command) for every command of the five apps."""
    import importlib

    for prog, module in APPS.items():
        group = typer.main.get_command(importlib.import_module(module).app)
        for name, cmd in group.commands.items():
            yield f"{prog} {name}", cmd


def jq(filter_: str, text: str) -> str:
    """``jq -e filter`` over ``text``; fails the test when jq cannot parse it or the filter is false."""
    out = subprocess.run(["jq", "-e", "-c", filter_], input=text, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"jq -e {filter_!r} exited {out.returncode}: {out.stderr}\non:\n{text}"
    return out.stdout


def test_every_command_takes_json():
    names = [name for name, cmd in commands()
             if name not in WITHOUT_JSON and not any("--json" in p.opts for p in cmd.params)]
    assert names == [], f"add --json to: {names}"


@needs_jq
@pytest.mark.parametrize("argv", [["rl-infer", "serve"], ["rl-train", "run"], ["rl-train", "sft", "-o", "x"],
                                  ["rl-sync", "run"], ["rl-cache", "serve"], ["rl-orchestrate", "run"]],
                         ids=lambda a: " ".join(a[:2]))
def test_print_config_as_json(argv, tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    out = subprocess.run([BIN / argv[0], *argv[1:], "--config", str(recipe), "--train.optim.lr", "0.5",
                          "--print-config", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    jq(f'.run_dir == "{tmp_path / "run"}" and .train.optim.lr == 0.5 and (.model.path | length > 0)', out.stdout)
    assert not (tmp_path / "run").exists()


@needs_jq
def test_up_prints_its_recipe_as_json(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    out = subprocess.run([BIN / "rl-orchestrate", "up", str(recipe), "--num-infer", "3", "--print-config", "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    jq(".up.num_infer == 3", out)


@needs_jq
def test_tasks_and_score_without_a_server(tmp_path):
    """tasks | (answers written by jq) | score: the reversed string scores 1, a wrong one less."""
    script = (f"{BIN}/rl-orchestrate tasks --env reverse -n 3 --json "
              "| jq -c '. + {completions: [.answer, \"zz\"]}' "
              f"| {BIN}/rl-orchestrate score --env reverse --json")
    out = subprocess.run(["bash", "-o", "pipefail", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert jq("select(.rewards[0] == 1 and .rewards[1] < 1) | .prompt", out.stdout).count("\n") == 3


@needs_jq
def test_sync_status_as_json_and_text(tmp_path):
    from rlcli.sync.status import STATUS_FILE
    from rlcli.transport.atomic import atomic_write_json

    status = {"backend": "filesystem", "policy_version": 3, "latest_published": 4,
              "servers": {"infer-0": {"version": 3, "host": "h", "pid": 1, "state": "admitted", "last_error": None}},
              "last_update": {"version": 3, "total_s": 0.5}}
    atomic_write_json(tmp_path / STATUS_FILE, status)
    out = subprocess.run([BIN / "rl-sync", "status", str(tmp_path), "--json"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    jq('.policy_version == 3 and .servers["infer-0"].state == "admitted"', out)
    text = subprocess.run([BIN / "rl-sync", "status", str(tmp_path)], capture_output=True, text=True, timeout=60,
                          check=True).stdout
    assert "policy v3 live" in text and "infer-0" in text


@needs_jq
def test_finish_writes_exit_code_and_progress(tmp_path, capsys, monkeypatch):
    """What `rl-train/rl-sync/rl-orchestrate run --json` write when they end (rank 0 only)."""
    from rlcli.cli.common import finish
    from rlcli.transport.rundir import RunDir

    run = RunDir(tmp_path)
    run.write_progress("train", step=5)
    with pytest.raises(typer.Exit) as stop:
        finish(run, "train", 0, True)
    assert stop.value.exit_code == 0
    jq(f'.command == "train" and .exit_code == 0 and .progress.step == 5 and .run_dir == "{tmp_path}"',
       capsys.readouterr().out)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(typer.Exit) as stop:
        finish(run, "train", 1, True)
    assert stop.value.exit_code == 1 and capsys.readouterr().out == ""
