"""Adaptive thread counts: the processes of a run on one CPU host share its cores by who is busy.

On a CPU box rl-train and rl-infer compete for the same few cores. Fixed thread counts
waste them: with one thread each, the trainer computes on one core while the engine,
idle between batches, leaves the other unused; with all cores each, their OpenMP teams
oversubscribe the cores whenever both compute, and a team waits at every barrier for its
preempted thread. Here each process says when it computes, and every busy process takes
an equal share of the cores (the trainer takes the remainder): the trainer takes all of
them while the engine idles and yields half as soon as the engine generates.

Mechanism: each process maps one small file, ``RUN/cores/<host>/<role>-<id>-<pid>``, whose
first byte is its thread count while it computes (0: idle). :meth:`CoreShare.adapt` reads
the others' bytes (a memory read, no system call; the directory is rescanned every
``rescan_s`` for processes that came or went, and files of dead pids are ignored) and calls
``torch.set_num_threads`` when the share changed.

Other users of the host count too: a team of threads on an oversubscribed core is worse
than one thread (every barrier waits for a descheduled member). At each rescan the
runnable tasks of the host (``/proc/loadavg``) minus the board's own threads give the
load from outside the run (smoothed); the busy processes split only the cores it leaves,
at least one thread each. When that count says others are running, the tasks are counted
again one by one (``/proc/*/task/*/stat``) leaving out those at a lower priority than ours
(a higher nice value): the scheduler gives a nice-19 background job 15/1024 of a core
against a nice-0 team, so it does not stall our barriers and must not shrink our teams.
With scheduler autogroups on (``kernel.sched_autogroup_enabled``), nice values only order
tasks of one session, so there every runnable task counts. Only tasks on the cores this process
may run on count (its CPU affinity): under a Slurm cpuset, or `taskset`, the jobs beside ours on
the node's other cores take nothing from our teams. It must be called from the
thread that runs the compute (torch's intra-op thread count is per calling thread): the
engine calls it before each step, the trainer from hooks between layers (forward and
backward), so a change reaches a running step within one layer. Files live per host, so processes on other hosts never count.
"""

import mmap
import os
import socket
import time
from pathlib import Path
from typing import Callable


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


class CoreShare:
    """This process's entry in the run's core-sharing board (module docstring)."""

    def __init__(self, run_root: str | Path, role: str, instance: int = 0, max_threads: int = 0,
                 set_threads: Callable[[int], None] = _set_torch_threads, rescan_s: float = 1.0,
                 runnable: Callable[[], int | None] = None, competing: Callable[[], int | None] = None):
        self.directory = Path(run_root) / "cores" / socket.gethostname()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.role = role
        self.cores = host_cores()
        self.max_threads = min(max_threads, self.cores) if max_threads else self.cores
        self.set_threads = set_threads
        self.rescan_s = rescan_s
        self.path = self.directory / f"{role}-{instance}-{os.getpid()}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"\0")
        self._mine = mmap.mmap(fd, 1)
        os.close(fd)
        self._peers: dict[str, mmap.mmap] = {}
        self._scanned = 0.0
        self.runnable = runnable or _runnable_tasks
        # The exact count, run only when the cheap one sees outside load (injected: tests).
        self.competing = competing or ((lambda: None) if runnable else _competing_tasks)
        self.external = 0.0  # smoothed load from outside the board, in cores
        self.threads = 0
        self.is_busy = False

    def busy(self, flag: bool) -> int:
        """Mark this process computing (or not), then :meth:`adapt`."""
        self.is_busy = flag
        return self.adapt()

    def share(self) -> int:
        """Threads for this process now: the cores that outside load leaves, split over the busy
        processes (itself counted), the trainer taking the remainder; at least one."""
        peers = [m[0] for m in self._peer_maps() if m[0]]
        n = len(peers) + 1
        free = max(self.cores - round(self.external), 1)
        threads = free // n + (free % n if self.role == "train" else 0)
        return max(1, min(threads, self.max_threads))

    def adapt(self) -> int:
        """Set this thread's torch thread count to :meth:`share` if it changed; returns it."""
        threads = self.share()
        if threads != self.threads:
            self.set_threads(threads)
            self.threads = threads
        mine = min(threads, 255) if self.is_busy else 0
        if self._mine[0] != mine:
            self._mine[0] = mine
        return threads

    def _peer_maps(self):
        now = time.monotonic()
        if now - self._scanned > self.rescan_s:
            self._scanned = now
            self._rescan()
            running = self.runnable()
            if running is not None:
                ours = sum(m[0] for m in self._peers.values()) + (self.threads if self.is_busy else 0)
                # The reading thread itself is runnable; an idle process still counts itself once.
                outside = max(running - max(ours, 1), 0)
                if outside and (exact := self.competing()) is not None:
                    outside = max(exact - max(ours, 1), 0)
                self.external = 0.5 * self.external + 0.5 * outside
        return self._peers.values()

    def _rescan(self) -> None:
        try:
            names = {p.name for p in self.directory.iterdir() if p != self.path}
        except FileNotFoundError:
            names = set()
        for name in list(self._peers):
            if name not in names or not _alive(name):
                self._peers.pop(name).close()
        for name in names - set(self._peers):
            if not _alive(name):
                continue
            try:
                with open(self.directory / name, "rb") as f:
                    self._peers[name] = mmap.mmap(f.fileno(), 1, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # vanished, or not written yet
                continue

    def close(self) -> None:
        for m in self._peers.values():
            m.close()
        self._peers.clear()
        self._mine.close()
        self.path.unlink(missing_ok=True)


def _runnable_tasks() -> int | None:
    """Tasks of the host that are running or ready to run right now (Linux), else None."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def _competing_tasks(proc: str = "/proc") -> int | None:
    """Runnable tasks on this process's cores at its priority or higher (nice <= ours), or at
    any priority with scheduler autogroups on (nice then orders only one session's tasks); None
    where /proc cannot be read."""
    by_nice = True
    try:
        with open(f"{proc}/sys/kernel/sched_autogroup_enabled") as f:
            by_nice = f.read().strip() == "0"
    except OSError:  # no autogroup support: nice orders all tasks
        pass
    if not os.path.isdir(f"{proc}/self/task"):
        return None
    return sum(competing_tasks_by_pid(proc, by_nice=by_nice).values())


def competing_tasks_by_pid(proc: str = "/proc", cpus: set[int] | None = None,
                           by_nice: bool = True) -> dict[int, int]:
    """Per process: its tasks that are running or ready to run (state R) at a nice value no
    higher than this process's (any, without ``by_nice``), on one of ``cpus`` (default: the cores this process may run on;
    a runnable task sits on one core's run queue, and a task pinned elsewhere never reaches
    ours). Tasks that vanish while being read are skipped."""
    mine = os.getpriority(os.PRIO_PROCESS, 0) if by_nice else 40  # nice values run from -20 to 19
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:  # not Linux
            cpus = None
    out: dict[int, int] = {}
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"{proc}/{pid}/task/{tid}/stat", "rb") as f:
                    stat = f.read()
                fields = stat[stat.rindex(b")") + 2:].split()  # the name may hold spaces
                # Fields 3 (state), 19 (nice) and 39 (the core whose run queue holds the task).
                if fields[0] == b"R" and int(fields[16]) <= mine and (cpus is None or int(fields[36]) in cpus):
                    out[int(pid)] = out.get(int(pid), 0) + 1
            except (OSError, ValueError, IndexError):
                continue
    return out


def _alive(name: str) -> bool:
    try:
        pid = int(name.rsplit("-", 1)[1])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def hook_layers(cores: CoreShare, layers) -> list:
    """Call ``cores.adapt()`` before each of ``layers`` runs forward and when backward reaches
    its output, so a running step follows the board within one layer. Returns the handles."""
    import torch

    def backward_hook(grad):
        cores.adapt()
        return grad

    def forward_hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(backward_hook)
        return output

    def forward_pre_hook(module, args):
        cores.adapt()  # returns None: the layer's inputs stay as they are

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(forward_pre_hook))
        handles.append(layer.register_forward_hook(forward_hook))
    return handles
