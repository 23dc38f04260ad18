"""Shell completion: the committed scripts are current, click answers each shell's protocol, and TAB
completes in real bash, zsh and fish sessions driven through tmux, as a user would type."""

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlcli.cli import completions

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "completions"
BIN = Path(sys.executable).parent


def _env(**extra) -> dict:
    return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **extra}


def test_committed_files_are_current():
    for name, text in completions.render().items():
        assert (SCRIPTS / name).read_text() == text, (
            f"completions/{name} is stale: run `python -m rlcli.cli.completions` and commit the result")
    assert sorted(p.name for p in SCRIPTS.iterdir()) == sorted(completions.FILES.values())


def test_check_names_the_stale_file(tmp_path, capsys):
    assert completions.main(["--check", "--out-dir", str(tmp_path)]) == 1
    assert "rlcli.bash is stale" in capsys.readouterr().err
    assert completions.main(["--out-dir", str(tmp_path)]) == 0
    assert completions.main(["--check", "--out-dir", str(tmp_path)]) == 0
    (tmp_path / "rlcli.zsh").write_text("#compdef rl-train\n")
    assert completions.main(["--check", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "rlcli.zsh is stale" in err and len(err.strip().splitlines()) == 1


def _bash(prog: str, words: str, cword: int, cwd: Path) -> list[str]:
    var = f"_{prog.replace('-', '_').upper()}_COMPLETE"
    words = words.replace(" ", "\n")  # as the bash script passes them: "${COMP_WORDS[*]}" with IFS=$'\n'
    out = subprocess.run([prog], env=_env(COMP_WORDS=words, COMP_CWORD=str(cword), **{var: "complete_bash"}),
                         cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_click_answers_subcommands_options_and_the_default_subcommand(tmp_path):
    assert _bash("rl-orchestrate", "rl-orchestrate st", 1, tmp_path) == ["status"]
    assert _bash("rl-sync", "rl-sync --keep", 1, tmp_path) == ["--keep-weights"]
    # No subcommand named: rl-train's options are those of `rl-train run`, in completion as in execution.
    assert "--config" in _bash("rl-train", "rl-train --conf", 1, tmp_path)
    assert "--config" in _bash("rl-train", "rl-train run --conf", 2, tmp_path)
    assert _bash("rl-train", "rl-train conv", 1, tmp_path) == ["convert"]
    assert "--json" in _bash("rl-infer", "rl-infer generate --js", 2, tmp_path)


# ---------------------------------------------------------------------------------------------------------
# Real shells in tmux: type a prefix, press TAB, read the screen.

SHELLS = {
    "bash": (["bash", "--norc", "--noprofile", "-i"], ["source {script}"]),
    "zsh": (["zsh", "-f", "-i"], ["autoload -U compinit && compinit -u", "source {script}"]),
    "fish": (["fish", "--no-config", "-i"], ["source {script}"]),
}


class Tmux:
    def __init__(self, shell: str, cwd: Path, home: Path):
        argv, setup = SHELLS[shell]
        self.name = f"rlcli-{shell}-{uuid.uuid4().hex[:8]}"
        env = _env(HOME=str(home), PS1="$ ", TERM="xterm", XDG_CONFIG_HOME=str(home / ".config"),
                   XDG_DATA_HOME=str(home / ".local"))
        # A private server (-L): a tmux server someone else started would give our shells its environment.
        self.tmux = ["tmux", "-L", self.name]
        subprocess.run([*self.tmux, "new-session", "-d", "-s", self.name, "-x", "200", "-y", "50", "-c", str(cwd),
                        *argv], env=env, check=True, timeout=30)
        script = SCRIPTS / completions.FILES[shell]
        for line in setup:
            self.type(line.format(script=script), "Enter")
        self.type("clear", "Enter")
        time.sleep(0.5)

    def type(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", self.name, *keys], check=True, timeout=30)

    def screen(self) -> str:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-t", self.name], capture_output=True, text=True,
                              timeout=30).stdout

    def complete(self, prefix: str, expected: str, timeout_s: float = 30.0) -> str:
        """Type ``prefix``, press TAB, and wait until the line reads ``expected``; then clear the line."""
        self.type("-l", prefix)
        self.type("Tab")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            screen = self.screen()
            if expected in screen:
                break
            time.sleep(0.2)
        self.type("C-c")
        self.type("clear", "Enter")
        time.sleep(0.3)
        return screen

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True, timeout=30)


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_tab_completes_in_a_real_shell(shell, tmp_path):
    if not shutil.which("tmux") or not shutil.which(shell):
        pytest.skip(f"{'tmux' if not shutil.which('tmux') else shell} is not installed")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "a.toml").touch()
    (work / "b.gguf").touch()
    term = Tmux(shell, work, home)
    try:
        cases = [
            ("rl-sync --keep", "rl-sync --keep-weights"),           # an option
            ("rl-orchestrate stat", "rl-orchestrate status"),       # a subcommand
            ("rl-train --conf", "rl-train --config"),               # the default subcommand's option
            ("rl-train --config a.t", "rl-train --config a.toml"),  # a path
        ]
        for prefix, expected in cases:
            screen = term.complete(prefix, expected)
            assert expected in screen, f"{shell}: {prefix!r}<TAB> gave:\n{screen}"
    finally:
        term.close()
