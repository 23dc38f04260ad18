"""The commands as a user types them: help, exit codes, one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from procs import write_recipe

COMMANDS = {"rl-infer": "rlcli.cli.infer", "rl-train": "rlcli.cli.train", "rl-sync": "rlcli.cli.sync",
            "rl-cache": "rlcli.cli.cache", "rl-orchestrate": "rlcli.cli.orchestrate"}


def cli(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)


def one_line_error(out: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert out.returncode == code, (out.returncode, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("module", COMMANDS.values())
def test_help_is_light(module):
    """--help works and never imports torch (it must stay fast)."""
    code = (f"import sys; from {module} import app; import typer\n"
            "from typer.testing import CliRunner\n"
            "r = CliRunner().invoke(app, ['--help'])\n"
            "assert r.exit_code == 0, r.output\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("command,module", COMMANDS.items())
def test_short_help_and_version(command, module):
    """-h is --help, before and after the subcommand (the default one included); --version names the
    command and the package version."""
    from rlcli import __version__

    subcommand = {"rl-infer": "serve", "rl-cache": "serve"}.get(command, "run")
    for args in (["-h"], [subcommand, "-h"]):
        out = cli(module, *args)
        assert out.returncode == 0 and "Usage:" in out.stdout, (args, out.stderr)
    out = cli(module, "--version")
    assert out.returncode == 0 and out.stdout == f"{command} {__version__}\n", out.stderr


def test_the_orchestrator_and_the_client_do_not_import_torch():
    """rl-orchestrate's loop and the inference client (tokenizers, configs, messages) load without
    torch: rlcli.models loads its model exports on first use."""
    code = ("import sys; import rlcli.orchestrate.loop, rlcli.infer.client, rlcli.sync.syncer\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_print_config_writes_toml_to_stdout(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    out = cli("rlcli.cli.train", "--config", str(recipe), "--steps", "7", "--train.optim.lr", "0.5",
              "--print-config")
    assert out.returncode == 0, out.stderr
    import tomllib

    tree = tomllib.loads(out.stdout)
    assert tree["num_steps"] == 7 and tree["train"]["optim"]["lr"] == 0.5
    assert not (tmp_path / "run").exists()  # printing the config touches nothing


def test_up_train_nproc_sets_one_rollout_file_per_data_parallel_rank(tmp_path, tiny_model_dir):
    """rl-orchestrate up --train-nproc 4 --train.parallel.cp 2: two data-parallel ranks read rollout
    files (the context-parallel pairs share theirs); rl-train refuses any other count."""
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    ranks = {}
    for extra in ([], ["--train.parallel.cp", "2"], ["--train.parallel.cp", "2", "--orchestrate.num_train_ranks", "3"]):
        out = cli("rlcli.cli.orchestrate", "up", str(recipe), "--train-nproc", "4", *extra, "--print-config", "--json")
        assert out.returncode == 0, out.stderr
        tree = json.loads(out.stdout)
        assert tree["up"]["train_nproc_per_node"] == 4
        ranks[len(extra)] = tree["orchestrate"]["num_train_ranks"]
    assert ranks == {0: 4, 2: 2, 4: 3}  # an explicit override still wins


def test_staleness_flags_set_the_orchestrator_keys_of_run_and_up(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    for args in (("run", "--config", str(recipe)), ("up", str(recipe))):
        out = cli("rlcli.cli.orchestrate", *args, "--max-async", "2", "--max-off-policy-steps", "6",
                  "--print-config", "--json")
        assert out.returncode == 0, out.stderr
        tree = json.loads(out.stdout)["orchestrate"]
        assert (tree["max_async"], tree["max_off_policy_steps"]) == (2, 6), args
    one_line_error(cli("rlcli.cli.orchestrate", "up", str(recipe), "--max-off-policy-steps", "-1", "--print-config"),
                   2, "max_off_policy_steps")


def test_batch_invariant_flag_sets_the_one_model_key_for_every_command(tmp_path, tiny_model_dir):
    """--batch-invariant on rl-infer, rl-train and rl-orchestrate up: model.batch_invariant, which
    both sides read; with the vLLM engine it is one clear error."""
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    for module, *args in (("rlcli.cli.infer", "--config"), ("rlcli.cli.train", "--config"),
                          ("rlcli.cli.orchestrate", "up")):
        out = cli(module, *args, str(recipe), "--batch-invariant", "--print-config", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["model"]["batch_invariant"] is True, module
    one_line_error(cli("rlcli.cli.orchestrate", "up", str(recipe), "--batch-invariant", "--engine", "vllm",
                       "--print-config"), 2, "model.batch_invariant", "infer.engine.name = native")


_RANK_ERROR = """
import sys, typer
from rlcli.cli._errors import handle_errors
from rlcli.errors import ConfigError
app = typer.Typer()
@app.command()
@handle_errors("rl-train")
def run():
    raise ConfigError(sys.argv[1])
app(sys.argv[2:])
"""


def test_a_usage_error_under_torchrun_is_said_once_even_when_only_some_ranks_hit_it(tmp_path):
    """Every rank hitting one config error: one line, from the first. An error only ranks 2 and 3
    hit (a context-parallel pair holding no row) was said by nobody (only rank 0 spoke), and the
    user saw rank 0's 'connection closed by peer' instead."""
    import os
    import uuid

    run_id = uuid.uuid4().hex
    said = []
    for rank, message in ((2, "lower --cp"), (3, "lower --cp"), (0, "same for all"), (1, "same for all")):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "TORCHELASTIC_RUN_ID": run_id}
        out = subprocess.run([sys.executable, "-c", _RANK_ERROR, message], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2
        said += [line for line in out.stderr.splitlines() if line.strip()]
    assert said == ["rl-train: error: lower --cp", "rl-train: error: same for all"]


def test_first_to_say_removes_markers_older_than_an_hour(tmp_path, monkeypatch):
    """Each distinct usage error under torchrun leaves an empty marker in the temp directory; the
    process that creates one removes those past SAID_KEEP_S, whose jobs have ended."""
    import os
    import tempfile
    import time

    from rlcli.cli import _errors

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    old, recent = tmp_path / "rlcli-error-old", tmp_path / "rlcli-error-recent"
    other = tmp_path / "not-ours"
    for f in (old, recent, other):
        f.touch()
    past = time.time() - _errors.SAID_KEEP_S - 10
    os.utime(old, (past, past))
    os.utime(other, (past, past))
    assert _errors.first_to_say("a new message")
    assert not _errors.first_to_say("a new message")  # the marker it left says it was said
    assert not old.exists() and recent.exists() and other.exists()
    assert len(list(tmp_path.glob("rlcli-error-*"))) == 2


def test_unknown_recipe_key(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run", train={"learning_rate": 1})
    one_line_error(cli("rlcli.cli.train", "--config", str(recipe)), 2, "unknown key 'train.learning_rate'")


def test_unknown_option(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    one_line_error(cli("rlcli.cli.orchestrate", "run", "--config", str(recipe), "--bogus", "1"), 2, "--bogus")


@pytest.mark.parametrize("module, args", [("rlcli.cli.train", []), ("rlcli.cli.orchestrate", ["run"]),
                                          ("rlcli.cli.orchestrate", ["up"])])
def test_missing_model_directory(tmp_path, tiny_model_dir, module, args):
    recipe = write_recipe(tmp_path / "r.toml", tmp_path / "nope", tmp_path / "run")
    if args == ["up"]:
        out = cli(module, "up", str(recipe))
    else:
        out = cli(module, *args, "--config", str(recipe))
    one_line_error(out, 2, "model directory", "nope", "model.path")
    assert not (tmp_path / "run").exists()


def test_unreachable_peers(tmp_path, tiny_model_dir):
    one_line_error(cli("rlcli.cli.cache", "stats", "--connect", "tcp://127.0.0.1:9", "--timeout", "1"), 1,
                   "cannot reach rl-cache at tcp://127.0.0.1:9")
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    one_line_error(cli("rlcli.cli.orchestrate", "run", "--config", str(recipe), "--connect", "tcp://127.0.0.1:9"),
                   1, "cannot reach rl-infer at tcp://127.0.0.1:9")
    one_line_error(cli("rlcli.cli.infer", "generate", "hello", "--run-dir", str(tmp_path / "empty")), 1,
                   "no live rl-infer")


def test_run_directory_of_another_recipe(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    first = write_recipe(tmp_path / "a.toml", tiny_model_dir, run_dir)
    assert cli("rlcli.cli.orchestrate", "run", "--config", str(first), "--steps", "1",
               "--connect", "tcp://127.0.0.1:9").returncode == 1  # claims the run directory, then fails
    other = write_recipe(tmp_path / "b.toml", tiny_model_dir, run_dir, top={"name": "other"})
    one_line_error(cli("rlcli.cli.train", "--config", str(other)), 2, "belongs to recipe 'e2e'", "--run-dir")


def test_a_process_started_by_hand_logs_into_the_run(tmp_path, tiny_model_dir):
    """RUN/logs/<command>-<id>.log gets the log lines of a process no launcher started, and the
    one error line it ended with; stderr still gets them alone, once."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir)
    out = cli("rlcli.cli.orchestrate", "run", "--config", str(recipe), "--steps", "1", "--connect",
              "tcp://127.0.0.1:9")
    one_line_error(out, 1, "cannot reach rl-infer at tcp://127.0.0.1:9")
    log = (run_dir / "logs" / "orchestrate-0.log").read_text().splitlines()
    assert log[-1] == out.stderr.strip()
    out = cli("rlcli.cli.infer", "--config", str(recipe), "--id", "3", "--json", "--print-config")
    assert out.returncode == 0 and not (run_dir / "logs" / "infer-3.log").exists()  # it joined no run


def test_status_of_a_directory_that_is_no_run_is_one_error_line(tmp_path):
    one_line_error(cli("rlcli.cli.orchestrate", "status", str(tmp_path)), 2, "not a run directory")


def test_debug_env_shows_traceback(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run", train={"learning_rate": 1})
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.train", "--config", str(recipe)], capture_output=True,
                         text=True, env={**__import__("os").environ, "RLCLI_DEBUG": "1"})
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_sft_command_writes_a_loadable_model(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run", train={"sft": {"batch_size": 8}})
    out = cli("rlcli.cli.train", "sft", "--config", str(recipe), "--steps", "3", "--out", str(tmp_path / "sft"),
              "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"out": str(tmp_path / "sft"), "sft_steps": 3}
    from rlcli.models import load_model

    model = load_model(tmp_path / "sft")
    assert (tmp_path / "sft" / "STABLE").is_file() and model.args.vocab_size == 259
    assert json.loads((tmp_path / "sft" / "tokenizer_config.json").read_text())["tokenizer_class"] == "ByteTokenizer"


def test_process_title_names_the_command(tmp_path, tiny_model_dir):
    """`ps` and `top` show `rl-cache serve ...`, not `python -m rlcli.cli.cache`."""
    from procs import Procs, wait_until

    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    procs = Procs(tmp_path / "logs")
    try:
        proc = procs.start("cache", recipe)
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        title = wait_until(lambda: cmdline.read_bytes().split(b"\0")[0].decode().startswith("rl-cache serve")
                           and cmdline.read_bytes(), 60, "the process title", procs)
        assert b"--config" in title
    finally:
        procs.stop_all()
