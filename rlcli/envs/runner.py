"""Running an environment's code off the dispatch loop: worker threads with a deadline.

The orchestrator's loop dispatches requests and polls replies every 20 ms; a verifier
that takes a second per completion, run inline, would stall both. :class:`EnvRunner` runs
each ``reward`` / ``respond`` call on a worker thread, at most ``env.num_workers``
at a time (the rest queue), and hands back results from :meth:`EnvRunner.poll` as they
finish. By default the thread makes the call itself: a user's environment need not be
picklable, and the calls that are slow in practice (sandboxed subprocesses, HTTP judges,
sleeps) release the GIL. A pure-Python CPU-bound reward (math verification) holds the GIL
against the loop and the other calls, so ``env.executor = "processes"`` gives each worker
thread a worker process (:class:`EnvProcess`) that holds its own copy of the environment,
built from the env table; the thread sends it the call and waits for the answer.

A call past ``env.reward_timeout_s`` is given up: its result is ``env.on_error``, its slot
is freed for the next call, and its thread (which Python cannot kill) finishes in the
background and is ignored; its worker process, if it has one, is killed. A call that
raises, or returns something of the wrong type (a reward must be a finite real number; a
turn a string, a ``{"role", "content"}`` dict or None), is logged with the environment's
name and also counts as an error; the run goes on. With ``env.retries = N`` a call that
failed either way is run again, up to N more times (a sandbox that timed out, a judge that
dropped its connection), each attempt with a deadline of its own; only the last failure
counts. ``num_workers = 0`` runs calls inline, as the loop used to.
"""

import asyncio
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable

log = logging.getLogger("rlcli.envs")


@dataclass
class Outcome:
    """What one call gave: ``value`` (checked), or ``error`` (then ``value`` is the fallback)."""

    value: Any
    error: str | None
    seconds: float


def check_reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward returned {type(value).__name__} {value!r:.60}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward returned {value}")
    return value


def check_turn(value: Any) -> dict[str, str] | None:
    """A ``respond`` result as a message dict (None ends the episode)."""
    if value is None:
        return None
    if isinstance(value, str):
        return {"role": "user", "content": value}
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return {"role": str(value.get("role", "user")), "content": value["content"]}
    raise TypeError(f"respond returned {type(value).__name__} {value!r:.60}; expected a string, "
                    "a {'role', 'content'} dict or None")


def call(fn: Callable, args: tuple, check: Callable[[Any], Any]) -> Any:
    """``check(fn(*args))``, awaiting ``fn`` when it is a coroutine function."""
    value = fn(*args)
    if inspect.isawaitable(value):
        value = asyncio.run(_await(value))
    return check(value)


async def _await(awaitable):
    return await awaitable


def describe(e: BaseException) -> str:
    if isinstance(e, EnvProcessError):
        return str(e)[:300]
    return f"{type(e).__name__}: {e}"[:300]


class EnvProcessError(Exception):
    """A call that failed in a worker process (its message: the failure there, described)."""


def _serve(conn, env_table: dict) -> None:
    """A worker process: build the environment, then answer ``(method, args)`` calls until EOF."""
    import msgspec

    from rlcli.config.env import EnvConfig
    from rlcli.envs import make_env

    env = make_env(msgspec.convert(env_table, EnvConfig))
    while True:
        try:
            what, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer = (True, call(getattr(env, what), args, lambda value: value))
        except BaseException as e:
            answer = (False, describe(e))
        try:
            conn.send(answer)
        except Exception as e:  # an answer that does not pickle
            conn.send((False, f"{what} returned what cannot be sent back: {describe(e)}"))


class EnvProcess:
    """A worker process of ``env.executor = "processes"`` with its own copy of the environment."""

    def __init__(self, env_table: dict):
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with sockets and threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, env_table), daemon=True, name="rl-env")
        self.proc.start()
        child.close()

    def call(self, what: str, args: tuple) -> Any:
        self.conn.send((what, args))
        try:
            ok, value = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(1)
            raise EnvProcessError(f"the environment's worker process ended (exit code {self.proc.exitcode}) "
                                  "during the call") from None
        if not ok:
            raise EnvProcessError(value)
        return value

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class EnvRunner:
    """Calls into one environment, run by ``num_workers`` threads with a per-call deadline.

    A worker that finishes a call takes the next waiting one itself, so a queue of short calls
    (256 rewards of one step) drains at the speed of the calls, not one ``poll`` per call. A
    worker whose call ran past its deadline loses its slot (``poll`` starts a new worker in
    its place) and exits when the call returns, its result ignored. Each result also writes a
    byte to :attr:`wake_fd`, so a caller blocked on a poller wakes for it at once."""

    def __init__(self, name: str, num_workers: int, timeout_s: float, processes: dict | None = None,
                 retries: int = 0):
        """``processes``: the env table (as builtins) each worker process builds its environment
        from (``env.executor = "processes"``); None: calls run on the worker threads. ``retries``:
        how many more times a failed call is run before its failure counts."""
        self.name, self.num_workers, self.timeout_s, self.retries = name, num_workers, timeout_s, retries
        self.env_table = processes if num_workers > 0 else None
        self.idle: list[EnvProcess] = [EnvProcess(processes) for _ in range(num_workers)] if self.env_table else []
        self.process_of: dict[int, EnvProcess] = {}  # job -> the worker process running it
        self.results: queue.SimpleQueue = queue.SimpleQueue()  # (key, what, fallback, value, error, seconds)
        self.lock = threading.Lock()  # guards waiting and running, shared with the workers
        self.waiting: deque = deque()
        self.running: dict[int, tuple[Hashable, float, str, Any]] = {}  # job -> (key, started, what, fallback)
        self.calls: dict[Hashable, tuple[Callable, tuple, Callable, int]] = {}  # key -> (fn, args, check, attempt)
        self.done: list[tuple[Hashable, Outcome]] = []
        self.next_job = 0
        self.num_errors = 0
        self.num_timeouts = 0
        self.num_retries = 0
        self.busy_s = 0.0  # summed seconds of finished calls
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def wake_fd(self) -> int:
        """Readable when a call has finished since the last :meth:`poll` (a file descriptor to poll on)."""
        return self._wake_r

    def submit(self, key: Hashable, what: str, fn: Callable, args: tuple, check: Callable, fallback: Any) -> None:
        """Run ``check(fn(*args))``; :meth:`poll` later returns ``(key, Outcome)``. ``what`` names the
        call in logs ("reward", "respond"); ``fallback`` is the value on error."""
        if self.num_workers == 0:
            t0 = time.monotonic()
            for attempt in range(self.retries + 1):
                try:
                    outcome = Outcome(call(fn, args, check), None, 0.0)
                    break
                except Exception as e:  # the environment's own failure: logged and scored, never fatal
                    if attempt < self.retries:
                        self._retrying(what, describe(e), attempt + 1)
                    else:
                        outcome = self._failed(what, fallback, describe(e))
            outcome.seconds = time.monotonic() - t0
            self.busy_s += outcome.seconds
            self.done.append((key, outcome))
            return
        with self.lock:
            if self.retries:
                self.calls[key] = (fn, args, check, 0)
            self.waiting.append((key, what, fn, args, check, fallback))
        self._start()

    def _retry(self, key: Hashable, what: str, fallback: Any, error: str) -> bool:
        """Queue failed call ``key`` again if it has attempts left (caller holds no lock)."""
        with self.lock:
            spec = self.calls.pop(key, None)
            if spec is None or spec[3] >= self.retries:
                return False
            fn, args, check, attempt = spec
            self.calls[key] = (fn, args, check, attempt + 1)
            self.waiting.append((key, what, fn, args, check, fallback))
        self._retrying(what, error, attempt + 1)
        return True

    def _retrying(self, what: str, error: str, attempt: int) -> None:
        self.num_retries += 1
        log.warning("env %s: %s failed (%s); trying again (%d of env.retries=%d)", self.name, what, error,
                    attempt, self.retries)

    @property
    def num_pending(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.done) + self.results.qsize()

    def _take(self) -> tuple | None:
        """The next waiting call, registered as running (caller holds the lock)."""
        if not self.waiting or len(self.running) >= self.num_workers:
            return None
        key, what, fn, args, check, fallback = self.waiting.popleft()
        job, self.next_job = self.next_job, self.next_job + 1
        self.running[job] = (key, time.monotonic(), what, fallback)
        return job, what, fn, args, check

    def _start(self) -> None:
        while True:
            with self.lock:
                work = self._take()
            if work is None:
                return
            threading.Thread(target=self._work, args=work, daemon=True, name=f"env-{self.name}-{work[0]}").start()

    def _run(self, job: int, what: str, fn: Callable, args: tuple, check: Callable) -> Any:
        """One call: here, or in a worker process (one that is idle, or a new one in place of one
        killed), which goes back to the idle ones unless the call timed out and it was killed."""
        if self.env_table is None:
            return call(fn, args, check)
        with self.lock:
            proc = self.idle.pop() if self.idle else None
        if proc is None or not proc.alive():
            proc = EnvProcess(self.env_table)
        with self.lock:
            self.process_of[job] = proc
        try:
            value = proc.call(what, args)
        finally:
            with self.lock:
                if self.process_of.pop(job, None) is not None and proc.alive():
                    self.idle.append(proc)
        return check(value)

    def _work(self, job: int, what: str, fn: Callable, args: tuple, check: Callable) -> None:
        while True:
            try:
                value, error = self._run(job, what, fn, args, check), None
            except BaseException as e:  # reported by poll() with the environment's name
                value, error = None, describe(e)
            with self.lock:
                entry = self.running.pop(job, None)
                if entry is None:
                    return  # it timed out: poll() answered it and gave its slot to a new worker
                key, started, what, fallback = entry
                self.results.put((key, what, fallback, value, error, time.monotonic() - started))
                work = self._take()
            try:
                os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):  # full (the caller will poll anyway) or closed
                pass
            if work is None:
                return
            job, what, fn, args, check = work

    def _failed(self, what: str, fallback: Any, error: str) -> Outcome:
        self.num_errors += 1
        log.warning("env %s: %s failed (%s); scored %r", self.name, what, error, fallback)
        return Outcome(fallback, error, 0.0)

    def poll(self) -> list[tuple[Hashable, Outcome]]:
        """Calls that finished, failed or ran out of time since the last poll."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                key, what, fallback, value, error, seconds = self.results.get_nowait()
            except queue.Empty:
                break
            self.busy_s += seconds
            if error and self._retry(key, what, fallback, error):
                continue
            self.calls.pop(key, None)
            outcome = self._failed(what, fallback, error) if error else Outcome(value, None, 0.0)
            outcome.seconds = seconds
            self.done.append((key, outcome))
        now = time.monotonic()
        with self.lock:
            late = [(job, entry) for job, entry in self.running.items() if now - entry[1] > self.timeout_s]
            for job, _ in late:
                del self.running[job]
            killed = [p for p in (self.process_of.pop(job, None) for job, _ in late) if p is not None]
        for proc in killed:  # its thread's wait ends with the process; the call's answer is this timeout
            proc.kill()
        for job, (key, started, what, fallback) in late:
            self.num_timeouts += 1
            error = f"no result within env.reward_timeout_s={self.timeout_s}"
            if self._retry(key, what, fallback, error):
                continue
            outcome = self._failed(what, fallback, error)
            outcome.seconds = now - started
            self.done.append((key, outcome))
        self._start()
        done, self.done = self.done, []
        return done

    def wait(self, timeout_s: float) -> None:
        """Block until every submitted call is answered or ``timeout_s`` passes; the answers stay
        for :meth:`poll` (pipelines, tests)."""
        deadline = time.monotonic() + timeout_s
        while (self.waiting or self.running) and time.monotonic() < deadline:
            time.sleep(0.005)
            self.done = self.poll()

    def close(self) -> None:
        with self.lock:
            procs, self.idle = self.idle + list(self.process_of.values()), []
            self.process_of.clear()
        for proc in procs:
            proc.kill()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
