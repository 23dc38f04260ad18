"""EnvRunner: calls off the caller's thread, a deadline per call, and failures scored, never raised."""

import asyncio
import logging
import threading
import time

import pytest

from rlcli.envs.runner import EnvRunner, check_reward, check_turn


def collect(runner: EnvRunner, n: int) -> dict:
    out: dict = {}
    deadline = time.monotonic() + 30
    while len(out) < n and time.monotonic() < deadline:
        out.update(runner.poll())
        time.sleep(0.005)
    return out


def test_failures_are_scored_and_logged_with_the_env_name(caplog):
    release = threading.Event()

    def reward(kind):
        if kind == "raise":
            raise RuntimeError("verifier crashed")
        if kind == "string":
            return "1.0"
        if kind == "nan":
            return float("nan")
        if kind == "slow":
            release.wait(30)
            return 1.0
        return 0.5 if kind == "float" else True if kind == "bool" else 2

    runner = EnvRunner("my-env", num_workers=3, timeout_s=0.5)
    kinds = ["raise", "string", "nan", "slow", "float", "int", "bool"]
    with caplog.at_level(logging.WARNING, logger="rlcli.envs"):
        for k in kinds:
            runner.submit(k, "reward", reward, (k,), check_reward, -1.0)
        out = collect(runner, len(kinds))
    release.set()
    assert {k: o.value for k, o in out.items()} == {"raise": -1.0, "string": -1.0, "nan": -1.0, "slow": -1.0,
                                                   "float": 0.5, "int": 2.0, "bool": -1.0}
    assert "RuntimeError: verifier crashed" in out["raise"].error and "reward_timeout_s" in out["slow"].error
    assert out["float"].error is None
    assert runner.num_errors == 5 and runner.num_timeouts == 1
    assert all("env my-env: reward failed" in r.getMessage() for r in caplog.records) and len(caplog.records) == 5


def test_calls_leave_the_callers_thread_and_async_rewards_are_awaited():
    seen = []

    async def reward(x):
        seen.append(threading.current_thread().name)
        await asyncio.sleep(0)
        return x

    runner = EnvRunner("e", num_workers=2, timeout_s=10)
    for i in range(5):
        runner.submit(i, "reward", reward, (float(i),), check_reward, 0.0)
    out = collect(runner, 5)
    assert {k: o.value for k, o in out.items()} == {i: float(i) for i in range(5)}
    assert all(name.startswith("env-e-") for name in seen) and threading.current_thread().name not in seen


def test_inline_mode_runs_in_the_caller():
    runner = EnvRunner("e", num_workers=0, timeout_s=10)
    runner.submit("a", "respond", lambda: threading.current_thread().name, (), check_turn, None)
    ((key, outcome),) = runner.poll()
    assert key == "a" and outcome.value == {"role": "user", "content": threading.current_thread().name}


def test_turns_are_strings_dicts_or_none():
    assert check_turn(None) is None and check_turn("x") == {"role": "user", "content": "x"}
    assert check_turn({"role": "tool", "content": "7"}) == {"role": "tool", "content": "7"}
    with pytest.raises(TypeError):
        check_turn(3)


def test_workers_drain_the_queue_without_waiting_for_poll():
    """The workers take the next call themselves: 50 queued calls all run before any poll()."""
    ran = []
    runner = EnvRunner("e", num_workers=2, timeout_s=10)
    for i in range(50):
        runner.submit(i, "reward", lambda x: ran.append(x) or x, (float(i),), check_reward, 0.0)
    deadline = time.monotonic() + 30
    while len(ran) < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ran) == 50, f"only {len(ran)} of 50 calls ran before the first poll"
    out = dict(runner.poll())
    assert {k: o.value for k, o in out.items()} == {i: float(i) for i in range(50)}
    assert len({t.name for t in threading.enumerate() if t.name.startswith("env-e-")}) <= 2


CPU_ENV = '''
import os
from rlcli.envs import Task


class Cpu:
    def sample_task(self, rng):
        return Task(prompt="x")

    def reward(self, task, text):
        if text == "raise":
            raise ValueError("bad text")
        if text == "forever":
            while True:
                pass
        if text == "exit":
            os._exit(3)
        return float(os.getpid())
'''


def test_worker_processes_hold_their_own_environment_and_a_late_one_is_killed(tmp_path, monkeypatch):
    """env.executor = "processes": calls run in num_workers processes that built the environment from
    the env table (a CPU-bound reward no longer holds the orchestrator's GIL); a failure there is
    described as there; a call past its deadline gets its process killed, and a new one takes its
    place; a process that dies mid-call is an error, not a hang."""
    import os

    from rlcli.envs import Task

    (tmp_path / "cpuenv.py").write_text(CPU_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    runner = EnvRunner("cpu", num_workers=2, timeout_s=3.0, processes={"name": "cpuenv:Cpu"})
    task = Task(prompt="x")
    try:
        for i in range(6):
            runner.submit(i, "reward", None, (task, "pid"), check_reward, -1.0)
        pids = {o.value for o in collect(runner, 6).values()}
        assert len(pids) == 2 and os.getpid() not in pids
        runner.submit("raise", "reward", None, (task, "raise"), check_reward, -1.0)
        runner.submit("exit", "reward", None, (task, "exit"), check_reward, -1.0)
        out = collect(runner, 2)
        assert out["raise"].value == -1.0 and out["raise"].error == "ValueError: bad text"
        assert out["exit"].error == "the environment's worker process ended (exit code 3) during the call"
        runner.submit("forever", "reward", None, (task, "forever"), check_reward, -1.0)
        time.sleep(0.5)
        [spinning] = runner.process_of.values()
        out = collect(runner, 1)
        assert "reward_timeout_s" in out["forever"].error and not spinning.alive()
        for i in range(4):
            runner.submit(i, "reward", None, (task, "pid"), check_reward, -1.0)
        after = {o.value for o in collect(runner, 4).values()}
        assert after and all(p > 0 for p in after) and int(spinning.proc.pid) not in after
        procs = list(runner.idle)
    finally:
        runner.close()
    assert procs and not any(p.alive() for p in procs)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_env_retries_run_a_failed_call_again_and_only_the_last_failure_counts(num_workers, caplog):
    attempts: dict = {}

    def reward(name, fails, slow=False):
        attempts[name] = attempts.get(name, 0) + 1
        if attempts[name] <= fails:
            if slow:
                time.sleep(0.6)  # past the deadline: a timeout, tried again
                return 1.0
            raise ConnectionError("judge hung up")
        return 1.0

    runner = EnvRunner("flaky", num_workers=num_workers, timeout_s=0.3, retries=2)
    calls = {"once": (1,), "twice": (2,), "always": (5,)}
    if num_workers:
        calls["slow"] = (1, True)  # inline calls have no deadline
    with caplog.at_level(logging.WARNING, logger="rlcli.envs"):
        for name, args in calls.items():
            runner.submit(name, "reward", reward, (name, *args), check_reward, -1.0)
        out = collect(runner, len(calls))
    assert {k: o.value for k, o in out.items()} == {"once": 1.0, "twice": 1.0, "always": -1.0,
                                                   **({"slow": 1.0} if num_workers else {})}
    assert out["always"].error and "judge hung up" in out["always"].error
    assert attempts["once"] == 2 and attempts["twice"] == 3 and attempts["always"] == 3
    assert runner.num_errors == 1 and runner.num_retries == 1 + 2 + 2 + (1 if num_workers else 0)
    assert sum("trying again" in r.getMessage() for r in caplog.records) == runner.num_retries
