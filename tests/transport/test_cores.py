"""Adaptive thread counts: busy processes of one host split its cores; idle and dead ones do not count."""

import os
import subprocess
import sys

import pytest
import torch

from rlcli.transport.cores import CoreShare, hook_layers


def _share(tmp_path, role, instance, cores, calls=None, runnable=lambda: None):
    c = CoreShare(tmp_path, role, instance, set_threads=(calls.append if calls is not None else lambda n: None),
                  rescan_s=0.0, runnable=runnable)
    c.cores = c.max_threads = cores
    return c


def test_busy_processes_split_the_cores(tmp_path):
    calls = []
    train, infer = _share(tmp_path, "train", 0, 5, calls), _share(tmp_path, "infer", 0, 5)
    assert train.busy(True) == 5 and calls == [5]  # the engine idles: the trainer takes every core
    assert infer.busy(True) == 2  # both compute: an equal share, the trainer keeps the remainder
    assert train.adapt() == 3 and calls == [5, 3]
    infer.busy(False)
    assert train.adapt() == 5 and calls == [5, 3, 5]
    assert train.adapt() == 5 and len(calls) == 3  # unchanged: no call
    infer.close()
    assert not any(p.name.startswith("infer") for p in train.directory.iterdir())
    train.close()


def test_load_from_outside_the_run_shrinks_the_share(tmp_path):
    load = {"running": 1}
    train = _share(tmp_path, "train", 0, 4, runnable=lambda: load["running"])
    assert train.busy(True) == 4  # only this process runs
    load["running"] = 4 + 8  # its 4 threads and 8 tasks of other users
    for _ in range(6):
        threads = train.adapt()
    assert threads == 1  # a team of threads on oversubscribed cores would wait at every barrier
    load["running"] = threads + 2  # two cores busy elsewhere: the two left
    for _ in range(6):
        threads = train.adapt()
    assert threads == 2
    train.close()


def test_a_cap_and_dead_processes(tmp_path):
    train = _share(tmp_path, "train", 0, 4)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = train.directory / f"infer-0-{int(dead.stdout)}"
    stale.write_bytes(b"\1")  # a crashed server left its busy flag behind
    assert train.busy(True) == 4
    capped = CoreShare(tmp_path, "infer", 1, max_threads=1, set_threads=lambda n: None, rescan_s=0.0,
                       runnable=lambda: None)
    assert capped.busy(True) == 1
    train.close()
    capped.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_layers_follow_the_board_mid_step(tmp_path):
    """The trainer's hooks re-read the board between layers, forward and backward."""
    seen = []
    train = CoreShare(tmp_path, "train", 0, set_threads=lambda n: (torch.set_num_threads(n), seen.append(n)),
                      rescan_s=0.0, runnable=lambda: None)
    other = CoreShare(tmp_path, "infer", 0, set_threads=lambda n: None, rescan_s=0.0, runnable=lambda: None)
    layers = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    threads_in = []
    layers[2].register_forward_pre_hook(lambda m, a: [other.busy(True)] and None)  # the engine starts mid-forward
    layers[3].register_forward_pre_hook(lambda m, a: threads_in.append(torch.get_num_threads()))  # -> None
    hook_layers(train, list(layers))
    train.busy(True)
    before = torch.get_num_threads()
    y = layers(torch.randn(2, 8, requires_grad=True)).sum()
    other.busy(False)  # and stops before the backward
    y.backward()
    assert before == train.cores and threads_in == [train.cores // 2] and torch.get_num_threads() == train.cores
    train.close()
    other.close()


def test_background_jobs_at_lower_priority_do_not_count_as_outside_load():
    """A busy nice-19 process is not a competitor of a nice-0 run; a busy one at our priority is."""
    import time

    from rlcli.transport.cores import competing_tasks_by_pid

    if os.getpriority(os.PRIO_PROCESS, 0) >= 19:
        pytest.skip("this test runs at nice 19 already: nothing can run at a lower priority")
    spin = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"
    low = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", spin])
    same = subprocess.Popen([sys.executable, "-c", spin])
    try:
        # `nice` runs at our priority until it has lowered its own and exec'd: a sample taken before
        # that counts it as a competitor, rightly (seen once in a full-suite run).
        deadline = time.monotonic() + 10
        while os.getpriority(os.PRIO_PROCESS, low.pid) < 19 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen_same = seen_low = 0
        for _ in range(20):  # a spinner is runnable unless it is between time slices in the kernel
            tasks = competing_tasks_by_pid()
            seen_same += same.pid in tasks
            seen_low += low.pid in tasks
            time.sleep(0.05)
        assert seen_same >= 10 and seen_low == 0
    finally:
        low.kill()
        same.kill()
        low.wait()
        same.wait()


def _fake_task(proc, pid: int, state: str, nice: int, cpu: int) -> None:
    """A /proc/<pid>/task/<pid>/stat line with the fields the counter reads (3, 19, 39)."""
    fields = [state] + ["0"] * 15 + [str(nice)] + ["0"] * 19 + [str(cpu)] + ["0"] * 13
    task = proc / str(pid) / "task" / str(pid)
    task.mkdir(parents=True)
    (task / "stat").write_text(f"{pid} (a name) " + " ".join(fields) + "\n")


def test_priorities_decide_only_without_scheduler_autogroups(tmp_path):
    """With autogroups on, nice orders only one session's tasks: a nice-19 task counts too."""
    from rlcli.transport.cores import _competing_tasks

    (tmp_path / "sys" / "kernel").mkdir(parents=True)
    (tmp_path / "self" / "task").mkdir(parents=True)
    cpu = min(os.sched_getaffinity(0))
    _fake_task(tmp_path, 101, "R", 19, cpu)
    _fake_task(tmp_path, 102, "R", -5, cpu)
    _fake_task(tmp_path, 103, "S", -5, cpu)
    flag = tmp_path / "sys" / "kernel" / "sched_autogroup_enabled"
    flag.write_text("1\n")
    assert _competing_tasks(str(tmp_path)) == 2
    flag.write_text("0\n")
    assert _competing_tasks(str(tmp_path)) == (1 if os.getpriority(os.PRIO_PROCESS, 0) < 19 else 2)


def test_tasks_on_cores_outside_our_affinity_do_not_compete(tmp_path):
    """Jobs pinned beside ours (a Slurm cpuset, taskset) run on other cores: not outside load."""
    from rlcli.transport.cores import competing_tasks_by_pid

    _fake_task(tmp_path, 201, "R", 0, 0)
    _fake_task(tmp_path, 202, "R", 0, 1)
    _fake_task(tmp_path, 203, "R", 0, 1)
    assert competing_tasks_by_pid(str(tmp_path), cpus={0}, by_nice=False) == {201: 1}
    assert competing_tasks_by_pid(str(tmp_path), cpus={1}, by_nice=False) == {202: 1, 203: 1}
    assert competing_tasks_by_pid(str(tmp_path), cpus={0, 1}, by_nice=False) == {201: 1, 202: 1, 203: 1}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_spinner_pinned_to_another_core_is_not_counted():
    """The real /proc: a busy process pinned to core B counts for core B's runs only."""
    import time

    from rlcli.transport.cores import competing_tasks_by_pid

    a, b = sorted(os.sched_getaffinity(0))[:2]
    spin = f"import os, time\nos.sched_setaffinity(0, {{{b}}})\nend = time.time() + 60\nwhile time.time() < end: pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        seen_b = seen_a = 0
        time.sleep(0.2)  # past its start-up, pinned
        for _ in range(20):
            seen_b += proc.pid in competing_tasks_by_pid(cpus={b}, by_nice=False)
            seen_a += proc.pid in competing_tasks_by_pid(cpus={a}, by_nice=False)
            time.sleep(0.05)
        assert seen_b >= 10 and seen_a == 0
    finally:
        proc.kill()
        proc.wait()
