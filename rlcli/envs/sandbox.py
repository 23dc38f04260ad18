"""A sandboxed Python executor for tool-use environments: one subprocess per snippet.

The child is ``python -I`` (no PYTHONPATH, user site or current directory on its path)
started in a fresh temporary directory with an empty environment. Before the snippet
runs, the child itself (single-threaded, so no fork-safety concerns in the parent):

- sets resource limits: ``RLIMIT_CPU`` (then SIGXCPU kills it), ``RLIMIT_AS`` (allocations
  fail with MemoryError), ``RLIMIT_FSIZE`` and ``RLIMIT_NOFILE``;
- enters a new network namespace when it may (root: ``unshare(CLONE_NEWNET)``, which leaves
  it no interface but a downed loopback);
- installs an audit hook (PEP 578) that refuses sockets, subprocesses, forks, exec,
  ``ctypes``, and opening or listing any path outside its directory and the Python
  installation (read-only there): the run directory, home, /etc are out of reach.

An audit hook is a tripwire inside the interpreter, not a kernel boundary; with the
network namespace, rlimits and a wall-clock kill it keeps a model's snippets from
reaching the network or the run's files. Code that must withstand a determined attacker
needs a container or VM around the whole executor.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

_BOOTSTRAP = r'''
import os, resource, sys
box, cpu_s, mem_bytes, prefixes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL
resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET; fails quietly unless root
except Exception:
    pass
for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.")]:
    del sys.modules[name]
code = sys.stdin.read()
_real = os.path.realpath
_readable = tuple(_real(p) for p in [box, *prefixes])
_blocked = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "os.kill", "os.killpg", "ctypes.", "pty.", "os.chroot")

def _inside(path, roots):
    p = _real(os.fsdecode(path))
    return any(p == r or p.startswith(r + os.sep) for r in roots)

def _hook(event, args):
    if event.startswith(_blocked):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].split(".")[0] in ("ctypes", "_ctypes", "_posixsubprocess"):
        raise ImportError(f"sandbox: importing {args[0]} is not allowed")  # optional imports degrade
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        mode, flags = args[1] or "", args[2] or 0
        writing = any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if not _inside(args[0], (_real(box),) if writing else _readable):
            raise PermissionError(f"sandbox: cannot open {os.fsdecode(args[0])}")
    if event in ("os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
        if not _inside(args[0], _readable):
            raise PermissionError(f"sandbox: cannot list {os.fsdecode(args[0])}")
    if event in ("os.chdir", "os.remove", "os.rename", "os.rmdir", "os.mkdir",
                 "shutil.rmtree", "os.symlink", "os.link", "os.chmod", "os.chown", "os.truncate", "os.utime"):
        if args and isinstance(args[0], (str, bytes, os.PathLike)) and not _inside(args[0], (_real(box),)):
            raise PermissionError(f"sandbox: {event} outside the sandbox directory")

sys.addaudithook(_hook)
del _hook
exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__"})
'''


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def python_prefixes() -> list[str]:
    """Directories a snippet may read: the interpreter's installation (stdlib, site-packages)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sysconfig.get_paths()["stdlib"],
             sysconfig.get_paths()["platstdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return sorted(p for p in paths if p)


def run_python(code: str, *, cpu_s: int = 2, memory_mb: int = 256, timeout_s: float = 5.0,
               max_output_chars: int = 4096) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter; its stdout and stderr, cut to ``max_output_chars``."""
    box = tempfile.mkdtemp(prefix="rlcli-sandbox-")
    cmd = [sys.executable, "-I", "-c", _BOOTSTRAP, box, str(cpu_s), str(memory_mb << 20), *python_prefixes()]
    env = {"PATH": "/usr/bin:/bin", "HOME": box, "TMPDIR": box, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    try:
        proc = subprocess.Popen(cmd, cwd=box, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, text=True)
        try:
            out, err = proc.communicate(code, timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            timed_out = True
        return SandboxResult(out[:max_output_chars], err[-max_output_chars:], proc.returncode, timed_out)
    finally:
        shutil.rmtree(box, ignore_errors=True)
