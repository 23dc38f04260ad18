"""The Python executor of tool-use environments: limits, no network, no files outside its directory."""

import signal

from rlcli.envs.sandbox import run_python


def test_a_snippet_runs_and_prints():
    r = run_python("import json, math\nprint(json.dumps([math.factorial(10)]))")
    assert r.ok and r.stdout.strip() == "[3628800]"


def test_a_snippet_cannot_open_a_socket():
    for code in ("import socket\nsocket.socket()", "import socket\nsocket.create_connection(('127.0.0.1', 9))",
                 "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')"):
        r = run_python(code)
        assert r.returncode != 0 and "sandbox: socket." in r.stderr, (code, r.stderr)


def test_a_snippet_cannot_read_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "weights").mkdir(parents=True)
    (run_dir / "weights" / "secret.txt").write_text("do not read")
    for code in (f"print(open({str(run_dir / 'weights' / 'secret.txt')!r}).read())",
                 f"import os\nprint(os.listdir({str(run_dir)!r}))",
                 f"import pathlib\nprint(pathlib.Path({str(run_dir / 'weights' / 'secret.txt')!r}).read_text())",
                 "import os\nos.system('cat /etc/hostname')", "import subprocess\nsubprocess.run(['ls', '/'])",
                 "import ctypes"):
        r = run_python(code)
        assert r.returncode != 0 and "do not read" not in r.stdout and "sandbox" in r.stderr, (code, r.stderr)
    r = run_python("open('scratch.txt', 'w').write('mine')\nprint(open('scratch.txt').read())")
    assert r.ok and r.stdout.strip() == "mine"  # its own directory is writable


def test_cpu_and_memory_limits():
    r = run_python("while True:\n    pass", cpu_s=1, timeout_s=30)
    assert not r.timed_out and r.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    r = run_python("x = bytearray(2 << 30)", memory_mb=128)
    assert r.returncode != 0 and "MemoryError" in r.stderr


def test_wall_clock_limit_kills_a_sleeping_snippet():
    r = run_python("import time\ntime.sleep(60)", timeout_s=0.5)
    assert r.timed_out and not r.ok
