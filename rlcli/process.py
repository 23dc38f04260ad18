"""Process-level helpers shared by every command."""

import signal
from typing import Callable


def stop_on_signals(stop: Callable[[], None]) -> None:
    """Call ``stop`` on SIGTERM or SIGINT: service loops finish their step and exit cleanly
    (deregister, close sockets) instead of dying mid-write."""
    signal.signal(signal.SIGTERM, lambda signum, frame: stop())
    signal.signal(signal.SIGINT, lambda signum, frame: stop())


def _set_parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` for this process; False where it is not available."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0) == 0  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux
    ``PR_SET_PDEATHSIG``); True when set.

    torchrun starts each rank in a session of its own, so a SIGKILL to torchrun (a scheduler's
    timeout, a bench's ``killpg``, the launcher's last resort) would leave the ranks running,
    holding their GPUs and waiting on collectives that never come. A rank that calls this goes
    down with its torchrun. If the parent is already gone by the time the flag is set, the
    signal is raised here at once."""
    import os

    parent = os.getppid()
    if not _set_parent_death_signal(sig):
        return False
    if os.getppid() != parent:  # the parent died before the flag was set: nobody will send it
        os.kill(os.getpid(), sig)
    return True


def stop_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets SIGTERM (and stops as
    :func:`stop_on_signals` says) when the process ``parent`` that starts it exits, however
    it exits. ``rl-orchestrate up`` starts its children so: ``kill -9`` on it stops them too."""
    import os

    def preexec() -> None:
        _set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is ``pid``, read from /proc (empty where
    there is none)."""
    from pathlib import Path

    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out
