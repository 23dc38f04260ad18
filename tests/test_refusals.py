"""Refused starts: one line naming what to change, exit code 2, and nothing made or lost on the way:
click's usage errors, a run directory that cannot be one, a recipe refused before the run directory
is claimed (so the corrected command is not refused in turn), and `rl-train sft --out`."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from procs import write_recipe
from test_cli import one_line_error


def cli(module: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("module, args, needle", [
    ("rlcli.cli.train", ["--lr", "abc"], "Invalid value for '--lr'"),
    ("rlcli.cli.train", ["--steps", "1.5"], "Invalid value for '--steps'"),
    ("rlcli.cli.infer", ["--dtype", "int8"], "Invalid value for '--dtype'"),
    ("rlcli.cli.orchestrate", ["up"], "Missing argument 'recipe'"),
    ("rlcli.cli.cache", ["bogus"], "No such command 'bogus'"),
    ("rlcli.cli.sync", ["status"], "Missing argument"),
])
def test_usage_errors_are_one_line_naming_the_help_to_read(module, args, needle):
    """Not click's Usage box: one `prog: error:` line with the subcommand's --help to read, exit 2."""
    one_line_error(cli(module, *args), 2, needle, "--help`")


def test_a_group_without_a_subcommand_still_shows_its_help():
    out = cli("rlcli.cli.orchestrate")
    assert out.returncode == 2 and "Usage: rl-orchestrate" in out.stderr + out.stdout


def test_a_run_directory_that_cannot_be_one_is_named(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run")
    (tmp_path / "afile").write_text("keep me")
    one_line_error(cli("rlcli.cli.train", "--config", str(recipe), "--run-dir", str(tmp_path / "afile")), 2,
                   "is a file; pass another --run-dir")
    one_line_error(cli("rlcli.cli.sync", "--config", str(recipe), "--run-dir", str(tmp_path / "afile" / "sub")), 2,
                   "cannot create run directory", "pass another --run-dir")
    assert (tmp_path / "afile").read_text() == "keep me"


@pytest.mark.parametrize("module, args, needle", [
    ("rlcli.cli.orchestrate", ["run", "--env.args.min_len", "0"], "env.args.min_len"),
    ("rlcli.cli.infer", ["--model.path", "{tmp}/tiny-lama"], "check model.path"),
    ("rlcli.cli.sync", ["--model.path", "{tmp}/tiny-lama"], "check model.path"),
    ("rlcli.cli.infer", ["--env.args.min_len", "0"], "env.args.min_len"),  # the claim records env.args too
    ("rlcli.cli.cache", ["--env.args.min_len", "0"], "env.args.min_len"),
])
def test_a_refused_recipe_leaves_no_claim_on_the_run_directory(tmp_path, tiny_model_dir, module, args, needle):
    """The run directory records the recipe's model and environment when a process claims it: a start
    refused for a bad env.args or model.path must not have claimed it, or the corrected command would be
    refused as another recipe's."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir)
    args = [a.format(tmp=tmp_path) for a in args]
    if args[0] == "run":
        args = ["run", "--config", str(recipe), *args[1:]]
    elif module == "rlcli.cli.cache":
        args = ["serve", "--config", str(recipe), *args]
    else:
        args = ["--config", str(recipe), *args]
    one_line_error(cli(module, *args), 2, needle)
    assert not run_dir.exists()


@pytest.mark.parametrize("args, needle", [
    (["--env.args.min_len", "0"], "env.args.min_len"),
    (["--engine", "vllm"], "needs vLLM, which is not installed here"),
    (["--train-nproc", "2", "--train.parallel.ep", "2"], "--ep 2 needs a mixture-of-experts model"),
    (["--train.loss.kind", "no_such_loss_module:fn"], "train.loss.kind 'no_such_loss_module:fn': cannot import"),
    (["--train.loss.kind", "ppo"], "train.loss.kind 'ppo' is not a loss"),
])
def test_up_refuses_what_would_stop_a_child_before_starting_any(tmp_path, tiny_model_dir, args, needle):
    if "vllm" in args:
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            pytest.skip("vllm is installed here")
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir)
    one_line_error(cli("rlcli.cli.orchestrate", "up", str(recipe), *args), 2, needle)
    assert not run_dir.exists()  # no claim, no child, no log


def test_the_launcher_quotes_a_failed_childs_closing_line(tmp_path):
    from rlcli.orchestrate.launcher import closing_error

    log = tmp_path / "train-0.log"
    log.write_text("rl-train INFO starting\nrl-train: error: --ep 3 must divide the model's 8 experts\n"
                   "[rank0] exiting\n")
    assert closing_error(log) == "rl-train: error: --ep 3 must divide the model's 8 experts"
    log.write_text("rl-train INFO fine\n")
    assert closing_error(log) == "" and closing_error(tmp_path / "missing.log") == ""


def test_sft_refuses_an_out_that_would_lose_files_before_training(tmp_path, tiny_model_dir):
    """--out a file, or a directory holding files, is refused before any step (convert's rule:
    --overwrite replaces); with --overwrite the directory becomes the model."""
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run", train={"sft": {"batch_size": 2}})
    (tmp_path / "afile").write_text("keep me")
    notes = tmp_path / "important" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("mine")
    base = ["sft", "--config", str(recipe), "--steps", "1", "--out"]
    one_line_error(cli("rlcli.cli.train", *base, str(tmp_path / "afile")), 2, "is a file; pass a directory")
    one_line_error(cli("rlcli.cli.train", *base, str(notes.parent)), 2, "pass --overwrite")
    assert (tmp_path / "afile").read_text() == "keep me" and notes.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing moved aside
    out = cli("rlcli.cli.train", *base, str(notes.parent), "--overwrite")
    assert out.returncode == 0, out.stderr
    assert (notes.parent / "STABLE").is_file() and not notes.exists()


def test_atomic_dir_refuses_to_replace_a_file(tmp_path):
    from rlcli.transport.atomic import atomic_dir

    (tmp_path / "afile").write_text("keep me")
    with pytest.raises(NotADirectoryError):
        with atomic_dir(tmp_path / "afile"):
            pass
    assert (tmp_path / "afile").read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_bad_sft_dataset_line_is_named(tmp_path, tiny_model_dir):
    data = tmp_path / "demo.jsonl"
    data.write_text('{"prompt": "ab=", "completion": "ba"}\n\n{bad json\n')
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run",
                          train={"sft": {"dataset": str(data), "batch_size": 2}})
    out = tmp_path / "sft"
    one_line_error(cli("rlcli.cli.train", "sft", "--config", str(recipe), "--steps", "1", "--out", str(out)), 2,
                   f"{data}, line 3 is not JSON")
    data.write_text('{"prompt": "ab=", "completion": "ba"}\n{"prompt": "ab="}\n')
    one_line_error(cli("rlcli.cli.train", "sft", "--config", str(recipe), "--steps", "1", "--out", str(out)), 2,
                   "line 2: needs 'prompt' and 'completion' strings")
    data.write_bytes(b'{"prompt": "ab=", "completion": "ba"}\n{"prompt": "\xe9=", "completion": "x"}\n')
    one_line_error(cli("rlcli.cli.train", "sft", "--config", str(recipe), "--steps", "1", "--out", str(out)), 2,
                   f"{data}, line 2 is not UTF-8 text")  # was trained on as U+FFFD
    assert not out.exists()


def test_a_mistyped_flag_is_named_as_no_such_option_not_as_an_override(tmp_path):
    from rlcli.config.load import parse_overrides
    from rlcli.errors import ConfigError

    for args in (["--fp-8"], ["--dry-run"], ["--fp-8", "--steps", "2"]):
        with pytest.raises(ConfigError, match=f"no such option {args[0]} "):
            parse_overrides(args)
    with pytest.raises(ConfigError, match="override --train.optim.lr needs a value"):
        parse_overrides(["--train.optim.lr"])


def test_a_recipe_that_is_not_text_is_named(tmp_path):
    from rlcli.config import load_recipe
    from rlcli.errors import ConfigError

    recipe = tmp_path / "bin.toml"
    recipe.write_bytes(b"name = \"x\"\n\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"bin.toml: not UTF-8 text \(byte 11\)"):
        load_recipe(recipe)


def test_rl_infer_without_vllm_refuses_the_engine_before_claiming(tmp_path, tiny_model_dir):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir)
    one_line_error(cli("rlcli.cli.infer", "--config", str(recipe), "--engine", "vllm"), 2, "needs vLLM")
    assert not run_dir.exists()


@pytest.mark.parametrize("override, needle", [
    (["--train.loss.kl_tau", "nan"], "train.loss.kl_tau"),
    (["--train.loss.entropy_coef", "nan"], "train.loss.entropy_coef"),
    (["--seed", str(10 ** 23)], "seed (--seed)"),
    (["--train.num_threads", str(10 ** 20)], "train.num_threads"),
    (["--infer.engine.num_threads", str(10 ** 20)], "infer.engine.num_threads"),
])
def test_values_that_overflow_or_poison_the_step_are_refused(override, needle):
    from rlcli.config import load_recipe
    from rlcli.config.load import parse_overrides
    from rlcli.errors import ConfigError

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "reverse.toml"
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_recipe(recipe, {}, parse_overrides(override))


def test_seconds_and_thresholds_must_be_finite(tmp_path):
    from rlcli.errors import ConfigError
    from rlcli.transport.zmq import check_timeout

    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e300):
        with pytest.raises(ConfigError, match="--timeout must be > 0"):
            check_timeout(bad)
    (tmp_path / "run.json").write_text('{"name": "x"}')
    one_line_error(cli("rlcli.cli.orchestrate", "status", str(tmp_path), "--watch", "nan"), 2, "--watch")
    one_line_error(cli("rlcli.cli.orchestrate", "eval", "--env", "reverse", "--connect", "tcp://127.0.0.1:9",
                       "--threshold", "nan"), 2, "--threshold must be a finite reward")


def test_an_argument_that_is_not_text_is_still_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "status", str(tmp_path).encode() + b"/\xff"],
                         capture_output=True, timeout=120)
    assert out.returncode == 2 and b"Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_odd_targets_leave_nothing_behind(tmp_path):
    """atomic_write_bytes onto a directory fails without a temporary left; metrics with a damaged
    byte lose that line only; a disk tier or a recipe that is not what it should be is named."""
    from rlcli.cache.disk import DiskStore
    from rlcli.config import load_recipe
    from rlcli.errors import ConfigError
    from rlcli.transport.atomic import atomic_write_bytes
    from rlcli.transport.rundir import RunDir

    (tmp_path / "adir").mkdir()
    with pytest.raises(OSError):
        atomic_write_bytes(tmp_path / "adir", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]
    run = RunDir(tmp_path / "run")
    run.append_metrics("train", {"step": 1})
    with open(run.metrics_file("train"), "ab") as f:
        f.write(b'{"step": "\xff"}\n')
    run.append_metrics("train", {"step": 3})
    assert [m["step"] for m in run.read_metrics("train")] == [1, "\ufffd", 3]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="pass another --disk-dir"):
        DiskStore(tmp_path / "afile", 1 << 20)
    with pytest.raises(ConfigError, match="is not a file"):
        load_recipe(tmp_path / "adir")


def test_piped_lines_that_are_not_utf8_or_not_strings_are_named(tiny_model_dir):
    """Python reads a pipe with surrogateescape, so bytes that are not UTF-8 reached the tokenizer or
    the JSON writer and failed there without a line number; a completion that is no string was handed
    to the reward, which failed, and the record was scored env.on_error as if the model had been wrong."""
    def piped(module: str, data: bytes, *args: str) -> subprocess.CompletedProcess:
        out = subprocess.run([sys.executable, "-m", module, *args], input=data, capture_output=True, timeout=120)
        return subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode(errors="replace"),
                                           out.stderr.decode(errors="replace"))

    generate = ("generate", "--model", str(tiny_model_dir), "--connect", "tcp://127.0.0.1:9", "--timeout", "1")
    one_line_error(piped("rlcli.cli.infer", b"hello\n\xff\xfe world\n", *generate), 2,
                   "stdin line 2 is not UTF-8 text")
    one_line_error(piped("rlcli.cli.infer", b'{"prompt": "caf\xe9"}\n', *generate), 2, "stdin line 1 is not UTF-8")
    score = ("score", "--env", "reverse")
    one_line_error(piped("rlcli.cli.orchestrate", b'\n{"prompt": "ab", "completions": ["b\xffa"]}\n', *score), 2,
                   "stdin line 2 is not UTF-8 text")
    one_line_error(piped("rlcli.cli.orchestrate", b'{"prompt": "ab", "completions": ["ba", 5]}\n', *score), 2,
                   "record 1: each of 'completions' must be a string, got int")
    one_line_error(piped("rlcli.cli.orchestrate", b'{"prompt": null, "completions": ["ba"]}\n', *score), 2,
                   "record 1: 'prompt' must be a string, got NoneType")
    ok = piped("rlcli.cli.orchestrate", '{"prompt": "é", "completions": ["é", "x"]}\n'.encode(), *score)
    assert ok.returncode == 0 and '"rewards"' in ok.stdout, ok.stderr


@pytest.mark.parametrize("module, sub", [("rlcli.cli.train", "run"), ("rlcli.cli.infer", "serve"),
                                         ("rlcli.cli.orchestrate", "run"), ("rlcli.cli.orchestrate", "up"),
                                         ("rlcli.cli.sync", "run"), ("rlcli.cli.cache", "serve")])
def test_an_empty_run_dir_is_refused_not_taken_as_the_working_directory(tmp_path, tiny_model_dir, module, sub):
    """`--run-dir "$RUN"` with RUN unset gave Path(""), the working directory, and the run's files went there."""
    recipe = str(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run"))
    args = [recipe] if sub == "up" else ["-c", recipe]
    one_line_error(cli(module, sub, *args, "--run-dir", "", cwd=tmp_path), 2, "'--run-dir': is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.toml", "tiny"]
