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


FAST_FAIL = ("--orchestrate.request_timeout_s", "1")  # an unreachable --connect fails after 1 s, not 10


def test_unreachable_peers(tmp_path, tiny_model_dir):
    one_line_error(cli("rlcli.cli.cache", "stats", "--connect", "tcp://127.0.0.1:9", "--timeout", "1"), 1,
                   "cannot reach rl-cache at tcp://127.0.0.1:9")
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    one_line_error(cli("rlcli.cli.orchestrate", "run", "--config", str(recipe), "--connect", "tcp://127.0.0.1:9",
                       *FAST_FAIL), 1, "cannot reach rl-infer at tcp://127.0.0.1:9")
    one_line_error(cli("rlcli.cli.infer", "generate", "hello", "--run-dir", str(tmp_path / "empty")), 1,
                   "no live rl-infer")


def test_run_directory_of_another_recipe(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    first = write_recipe(tmp_path / "a.toml", tiny_model_dir, run_dir)
    assert cli("rlcli.cli.orchestrate", "run", "--config", str(first), "--steps", "1",
               "--connect", "tcp://127.0.0.1:9", *FAST_FAIL).returncode == 1  # claims the run directory, then fails
    other = write_recipe(tmp_path / "b.toml", tiny_model_dir, run_dir, top={"name": "other"})
    one_line_error(cli("rlcli.cli.train", "--config", str(other)), 2, "belongs to recipe 'e2e'", "--run-dir")


def test_a_process_started_by_hand_logs_into_the_run(tmp_path, tiny_model_dir):
    """RUN/logs/<command>-<id>.log gets the log lines of a process no launcher started, and the
    one error line it ended with; stderr still gets them alone, once."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir)
    out = cli("rlcli.cli.orchestrate", "run", "--config", str(recipe), "--steps", "1", "--connect",
              "tcp://127.0.0.1:9", *FAST_FAIL)
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


def invoke(module: str, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
    """``module``'s typer app run in this process (faster than a subprocess on a busy machine), as a
    CompletedProcess for one_line_error. The subcommand must be named (run_app adds the default one)."""
    import importlib

    from typer.testing import CliRunner

    result = CliRunner().invoke(importlib.import_module(module).app, list(args), input=input)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


NO_PEER = "tcp://127.0.0.1:9"


def test_launch_flags_below_one_name_the_flag(tmp_path, tiny_model_dir):
    """--nproc-per-node 0 or -2 and --nnodes 0 were reported as a mismatch of orchestrate.num_train_ranks
    and train.parallel.dp, keys the user never set; a malformed --rdzv-endpoint reached torchrun, and
    --nnodes or --rdzv-endpoint without --nproc-per-node was ignored."""
    recipe = str(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run"))
    for args, needle in ((["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
                         (["--nproc-per-node", "-2"], "--nproc-per-node must be >= 1, got -2"),
                         (["--nproc-per-node", "1", "--nnodes", "0"], "--nnodes must be >= 1, got 0"),
                         (["--nproc-per-node", "1", "--node-rank", "-1"], "--node-rank"),
                         (["--nproc-per-node", "1", "--rdzv-endpoint", "bogus:port"], "--rdzv-endpoint 'bogus:port'"),
                         (["--nproc-per-node", "1", "--rdzv-endpoint", "tcp://h:29400"], "is not HOST:PORT"),
                         (["--nproc-per-node", "1", "--rdzv-endpoint", "h:70000"], "is not HOST:PORT"),
                         (["--rdzv-endpoint", "h:29400"], "--rdzv-endpoint needs --nproc-per-node N"),
                         (["--nnodes", "2"], "--nnodes needs --nproc-per-node N")):
        one_line_error(invoke("rlcli.cli.train", "run", "-c", recipe, *args), 2, needle)
    assert not (tmp_path / "run").exists()


def test_sampling_flags_are_checked_up_front_naming_each(tmp_path, tiny_model_dir):
    """rl-infer generate --n 0 / --max-tokens 0 / --temperature -1 ended in `ValueError: sampling...`,
    exit 1, and rl-orchestrate eval's -k / --max-tokens / --temperature the same or another message."""
    model = ["--model", str(tiny_model_dir), "--connect", NO_PEER]
    for args, needle in ((["--n", "0"], "--n must be >= 1, got 0"),
                         (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
                         (["--max-tokens", "-1"], "--max-tokens must be >= 1, got -1"),
                         (["--temperature", "-1"], "--temperature must be a finite number >= 0")):
        one_line_error(invoke("rlcli.cli.infer", "generate", "hi", *model, *args), 2, needle)
    recipe = str(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run"))
    for args, needle in ((["-k", "0"], "-k must be >= 1, got 0"),
                         (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
                         (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
                         (["-n", "0"], "-n/--num must be >= 1, got 0"), (["-n", "-1"], "-n/--num must be >= 1")):
        one_line_error(invoke("rlcli.cli.orchestrate", "eval", "-c", recipe, "--connect", NO_PEER, *args), 2, needle)


def test_timeouts_must_be_positive(tmp_path, tiny_model_dir):
    """A --timeout of 0 or less reported a live peer as 'cannot reach ... (is it running?)'."""
    recipe = str(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run"))
    for module, args in (("rlcli.cli.infer", ["generate", "hi", "--model", str(tiny_model_dir)]),
                         ("rlcli.cli.orchestrate", ["eval", "-c", recipe]),
                         ("rlcli.cli.cache", ["stats"]), ("rlcli.cli.cache", ["ls"]),
                         ("rlcli.cli.cache", ["prune"])):
        for value in ("0", "-1"):
            one_line_error(invoke(module, *args, "--connect", NO_PEER, "--timeout", value), 2,
                           f"--timeout must be > 0 and at most 1e6 seconds, got {value}")


def test_a_malformed_connect_endpoint_names_the_flag(tmp_path, tiny_model_dir):
    """--connect bogus was `ZMQError: Invalid argument (addr='bogus')`, exit 1."""
    from rlcli.errors import ConfigError
    from rlcli.transport.zmq import RpcClient, check_endpoint

    recipe = str(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run"))
    for module, args in (("rlcli.cli.infer", ["generate", "hi", "--model", str(tiny_model_dir)]),
                         ("rlcli.cli.orchestrate", ["eval", "-c", recipe]),
                         ("rlcli.cli.orchestrate", ["run", "-c", recipe]),
                         ("rlcli.cli.cache", ["stats"]), ("rlcli.cli.cache", ["ls"])):
        for bogus in ("bogus", "tcp://127.0.0.1", "tcp://127.0.0.1:abc", "tcp://127.0.0.1:70000"):
            one_line_error(invoke(module, *args, "--connect", bogus), 2, "--connect", repr(bogus),
                           "tcp://HOST:PORT")
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed
    assert check_endpoint("tcp://[::1]:5555") and check_endpoint("tcp://node-3.cluster:80")
    with pytest.raises(ConfigError, match="tcp://HOST:PORT"):  # the library's own fallback
        RpcClient("bogus")


def test_a_failed_bind_names_the_address_and_what_to_change(tmp_path, tiny_model_dir, monkeypatch):
    """A port in use or a host that is no address of this machine was a raw ZMQError; rl-cache serve
    also left its /dev/shm arena behind, having made it before binding."""
    import socket

    from rlcli.cache import server as cache_server
    from rlcli.config import load_recipe
    from rlcli.errors import ConfigError
    from rlcli.transport.zmq import Publisher, RpcServer

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"cannot bind tcp://127.0.0.1:{port}: the address is already in use"):
            RpcServer("127.0.0.1", port)
        with pytest.raises(ConfigError, match=r"cannot bind tcp://999.1.1.1:\*"):
            Publisher("999.1.1.1", 0)
        stores = []
        monkeypatch.setattr(cache_server, "make_store", lambda cfg: stores.append(cfg) or pytest.fail("no bind"))
        cfg = load_recipe(None, {"cache.port": port}, {})
        with pytest.raises(ConfigError, match="already in use"):
            cache_server.serve(cfg, None)
        assert stores == []  # no store (no /dev/shm arena) before the socket is bound
        one_line_error(cli("rlcli.cli.cache", "serve", "--port", str(port)), 2, f"tcp://127.0.0.1:{port}",
                       "already in use", "--port or cache.port")
    finally:
        held.close()
    one_line_error(cli("rlcli.cli.cache", "serve", "--host", "999.1.1.1"), 2, "tcp://999.1.1.1",
                   "--host or cache.host")


def test_a_second_store_on_a_held_run_makes_no_store_and_says_one_line(tmp_path, tiny_model_dir, monkeypatch):
    """rl-cache serve on a run another rl-cache holds made its /dev/shm arena and logged its start
    before the registry refused it."""
    from rlcli.cache import server as cache_server
    from rlcli.config import load_recipe
    from rlcli.errors import RunDirError
    from rlcli.cli.common import open_run

    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    cfg = load_recipe(recipe, {"cache.port": 0}, {})
    run = open_run(cfg, "cache")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from rlcli.transport.registry import "
                               "Registration; Registration(sys.argv[1], 'cache', 0, {'rpc': 'tcp://127.0.0.1:9'}); "
                               "print(flush=True); time.sleep(120)", str(run.registry_dir())],
                              stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()  # registered
        stores = []
        monkeypatch.setattr(cache_server, "make_store", lambda cfg: stores.append(cfg) or pytest.fail("a store"))
        with pytest.raises(RunDirError, match="cache-0 is already running"):
            cache_server.serve(cfg, run)
        assert stores == []
        out = cli("rlcli.cli.cache", "serve", "-c", str(recipe), "--port", "0")
        one_line_error(out, 2, "cache-0 is already running")  # nothing logged before it
    finally:
        holder.kill()
        holder.wait()
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    one_line_error(cli("rlcli.cli.sync", "--config", str(recipe), "--sync.host", "999.1.1.1"), 2,
                   "tcp://999.1.1.1", "--sync.host")


def test_disk_capacity_of_zero_names_the_flag(tmp_path):
    """--disk-capacity-mb 0 said `missing key 'cache.backend.name'` (a 0 was taken as not given)."""
    one_line_error(invoke("rlcli.cli.cache", "serve", "--disk-capacity-mb", "0", "--print-config"), 2,
                   "--disk-capacity-mb must be >= 1, got 0")
    out = invoke("rlcli.cli.cache", "serve", "--disk-dir", str(tmp_path / "d"), "--disk-capacity-mb", "5",
                 "--print-config", "--json")
    assert out.returncode == 0, out.stderr
    backend = json.loads(out.stdout)["cache"]["backend"]
    assert (backend["name"], backend["disk_capacity_mb"]) == ("memory", 5)


def test_prune_tier_is_a_choice_and_ls_limit_positive():
    """--tier floppy reached the store (an ErrorReply, or 'cannot reach'); --limit -5 listed nothing, exit 0."""
    out = cli("rlcli.cli.cache", "prune", "--connect", NO_PEER, "--tier", "floppy", "--timeout", "1")
    one_line_error(out, 2, "--tier", "floppy")
    one_line_error(invoke("rlcli.cli.cache", "ls", "--connect", NO_PEER, "--limit", "-5"), 2,
                   "--limit must be >= 1, got -5")
    one_line_error(invoke("rlcli.cli.cache", "ls", "--connect", NO_PEER, "--limit", "0"), 2, "--limit")


def test_generate_names_the_stdin_line_it_cannot_read(tiny_model_dir):
    """A `{` line that is not JSON, or a record whose prompt is no string, was a JSONDecodeError or
    AttributeError without a line number; `rl-orchestrate score` names the line, and so does this."""
    args = ("generate", "--model", str(tiny_model_dir), "--connect", NO_PEER, "--timeout", "1")
    one_line_error(invoke("rlcli.cli.infer", *args, input="{bad json\n"), 2, "stdin line 1", "not JSON")
    one_line_error(invoke("rlcli.cli.infer", *args, input='hello\n\n{"prompt": 5}\n'), 2, "stdin line 3",
                   '"prompt" must be a string, got int')
    one_line_error(invoke("rlcli.cli.infer", *args, input='{"prompt": "x", "max_tokens": "many"}\n'), 2,
                   "stdin line 1", '"max_tokens"')
    # Readable lines go on to the server (none here).
    one_line_error(invoke("rlcli.cli.infer", *args, input='hello\n{"prompt": "x"}\n{"other": 1}\n'), 1,
                   "cannot reach rl-infer")


@pytest.mark.parametrize("text", ["{}", "[1, 2]", '{"backend": "collective", "poli', '{"backend": "x", '
                                  '"policy_version": 1, "latest_published": 1, "servers": {"infer-0": 3}}'])
def test_sync_status_of_a_damaged_file_says_so(tmp_path, text):
    """A status.json of {} or [1,2] was a KeyError/TypeError (exit 1); a truncated one was reported
    as missing."""
    (tmp_path / "sync").mkdir()
    (tmp_path / "sync" / "status.json").write_text(text)
    one_line_error(invoke("rlcli.cli.sync", "status", str(tmp_path)), 2, "sync/status.json is ", "damaged (",
                   "rl-sync rewrites it")
    one_line_error(invoke("rlcli.cli.sync", "status", str(tmp_path / "nothing")), 2, "has no sync/status.json")


def test_tasks_num_must_be_positive(tmp_path, tiny_model_dir):
    """-n -3 wrote nothing and exited 0."""
    recipe = str(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run"))
    for value in ("-3", "0"):
        one_line_error(invoke("rlcli.cli.orchestrate", "tasks", "-c", recipe, "--env", "reverse", "-n", value), 2,
                       f"-n/--num must be >= 1, got {value}")
    out = cli("rlcli.cli.orchestrate", "tasks", "-c", recipe, "-n", "2")  # write_records' stdout is bound at import
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 2, out.stderr


def test_convert_refuses_a_file_as_output_and_names_overwrite(tmp_path):
    """OUT a regular file was NotADirectoryError (exit 1); a non-empty one said 'allow overwriting'."""
    pytest.importorskip("gguf")
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"not read before the output is checked")
    (tmp_path / "afile").write_text("x")
    one_line_error(invoke("rlcli.cli.train", "convert", str(gguf), str(tmp_path / "afile")), 2,
                   "is a file, not a directory")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    one_line_error(invoke("rlcli.cli.train", "convert", str(gguf), str(tmp_path / "full")), 2, "not empty",
                   "--overwrite")


def test_infer_id_must_not_be_negative(tmp_path, tiny_model_dir):
    """--id -1 was accepted and registered as infer--1."""
    recipe = str(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run"))
    one_line_error(invoke("rlcli.cli.infer", "serve", "-c", recipe, "--id", "-1", "--print-config"), 2,
                   "--id must be >= 0, got -1")
    assert invoke("rlcli.cli.infer", "serve", "-c", recipe, "--id", "0", "--print-config").returncode == 0


@pytest.mark.parametrize("text", ["{bad", "[1]", "{}", "\xff"])
def test_status_of_a_damaged_run_json_says_so(tmp_path, text):
    """A malformed run.json printed an empty table and exited 0."""
    (tmp_path / "run.json").write_bytes(text.encode("latin-1"))
    for args in ([], ["--json"]):
        one_line_error(invoke("rlcli.cli.orchestrate", "status", str(tmp_path), *args), 2, "run.json is ",
                       "damaged (")
    one_line_error(invoke("rlcli.cli.orchestrate", "plot", str(tmp_path)), 2, "run.json is ", "damaged (")
