"""CPU-bound rewards on worker threads vs worker processes (``env.executor``).

A pure-Python reward (math verification, a parser) holds the GIL. On threads the rewards run one
at a time and take the GIL from the orchestrator's dispatch loop; on processes each worker scores
in parallel and the loop keeps its interpreter. This bench scores ``--calls`` rewards of
``--work-ms`` of pure-Python work each (a fixed amount of work, timed alone) through
:class:`rlcli.envs.runner.EnvRunner` with ``--workers`` workers, once per executor, while a
stand-in for the dispatch loop runs in the main thread: iterations of 0.1 ms of Python work and a
1 ms wait that releases the GIL (its poll), polling the runner each time. Printed per executor:
the wall time to score every call and the loop's mean, 99th-percentile and longest iteration
(against an iteration with nothing scoring); then the ratios threads / processes.

    python bench/env_executor.py [--calls 64] [--work-ms 20] [--workers 2]
    python bench/env_executor.py --smoke
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ENV = '''
import time
from rlcli.envs import Task


class Busy:
    def __init__(self, rounds=1000):
        self.rounds = rounds

    def sample_task(self, rng):
        return Task(prompt="x")

    def reward(self, task, text):
        n = 0
        for _ in range(self.rounds):  # a fixed amount of pure-Python work: holds the GIL throughout
            n += sum(i * i for i in range(100))
        return 1.0
'''


def unit() -> None:
    sum(i * i for i in range(2000))  # about 0.1 ms: the loop's own Python work of one iteration


def iterate(stop) -> tuple[int, list[float]]:
    """The dispatch loop's stand-in: an iteration of Python work, then a 1 ms wait that releases the
    GIL (the loop's poll); returns the iterations and each one's length, until ``stop()``."""
    times, n = [], 0
    while True:  # at least one iteration: the calls may all be done by the first look
        t0 = time.perf_counter()
        unit()
        time.sleep(0.001)
        times.append(time.perf_counter() - t0)
        n += 1
        if stop():
            return n, times


def run(executor: str, args) -> dict:
    from rlcli.envs import Task
    from rlcli.envs.runner import EnvRunner, check_reward

    table = {"name": "busyenv:Busy", "args": {"rounds": args.rounds}}
    runner = EnvRunner("busy", args.workers, 600.0, processes=table if executor == "processes" else None)
    env = None
    if executor == "threads":
        import busyenv

        env = busyenv.Busy(args.rounds)
    try:
        if executor == "processes":  # the workers build their environments before the clock starts
            runner.submit("warm", "reward", None, (Task(prompt="x"), ""), check_reward, 0.0)
            while not runner.poll():
                time.sleep(0.01)
        done = [0]

        def finished() -> bool:
            done[0] += len(runner.poll())
            return done[0] >= args.calls

        t0 = time.perf_counter()
        for i in range(args.calls):
            runner.submit(i, "reward", env.reward if env else None, (Task(prompt="x"), ""), check_reward, 0.0)
        n, times = iterate(finished)
        wall = time.perf_counter() - t0
    finally:
        runner.close()
    times.sort()
    return {"executor": executor, "wall_s": wall, "loop_iter_ms": 1e3 * wall / n,
            "loop_p99_ms": 1e3 * times[int(0.99 * (len(times) - 1))], "loop_max_ms": 1e3 * times[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--work-ms", type=float, default=20.0, help="pure-Python work per reward call")
    p.add_argument("--workers", type=int, default=2, help="env.num_workers")
    p.add_argument("--smoke", action="store_true", help="8 calls of 5 ms")
    args = p.parse_args()
    if args.smoke:
        args.calls, args.work_ms = 8, 5.0
    env_dir = Path(tempfile.mkdtemp(prefix="env-executor-"))
    (env_dir / "busyenv.py").write_text(ENV)
    sys.path.insert(0, str(env_dir))  # spawned workers inherit it
    import busyenv

    one = busyenv.Busy(100)
    t0 = time.perf_counter()
    one.reward(None, "")
    args.rounds = max(1, round(100 * args.work_ms / 1e3 / (time.perf_counter() - t0)))  # work_ms of work, alone
    t0 = time.perf_counter()
    n, times = iterate(lambda: time.perf_counter() - t0 > 0.5)
    idle_ms = 1e3 * 0.5 / n
    rows = [run("threads", args), run("processes", args)]
    print(f"{args.calls} rewards of {args.work_ms:g} ms pure-Python work, {args.workers} workers; a loop "
          f"iteration alone: {idle_ms:.2f} ms")
    print(f"{'executor':<10} {'wall_s':>8} {'loop iter ms':>13} {'p99 ms':>8} {'max ms':>8}")
    for r in rows:
        print(f"{r['executor']:<10} {r['wall_s']:8.3f} {r['loop_iter_ms']:13.2f} {r['loop_p99_ms']:8.2f} "
              f"{r['loop_max_ms']:8.2f}")
    threads, processes = rows
    p99 = threads["loop_p99_ms"] / processes["loop_p99_ms"]
    print(f"ratio threads/processes: scoring wall {threads['wall_s'] / processes['wall_s']:.2f}x, loop iteration "
          f"{threads['loop_iter_ms'] / processes['loop_iter_ms']:.2f}x, p99 {p99:.2f}x")
    print(json.dumps({"idle_iter_ms": idle_ms, "threads": threads, "processes": processes}))


if __name__ == "__main__":
    main()
