"""A slow reward against the dispatch loop: inline scoring vs rewards on worker threads.

One rl-infer serves a tiny model; the orchestrator's own loop (``Orchestrator.loop``) runs
in this process on an environment whose reward sleeps ``--sleep`` seconds per call, for
``--steps`` batches of ``--episodes`` episodes (16 groups of 4 by default: 64 episodes).
A stand-in trainer announces policy N as soon as batch N is written, so the loop keeps
dispatching as a real run would. Run twice on the same server, side by side:

- inline: ``env.num_workers = 0``, the reward runs inside the loop (how scoring worked
  before environments ran off the loop);
- workers: ``env.num_workers = --workers``, the reward runs on worker threads.

Printed per mode: the loop's stall (time spent inside reply handling and scoring, when it
can neither dispatch nor poll; total and longest single stall), the wall time, the
fraction of that time the engine had work (sampled with health requests every 20 ms),
and the ratios inline / workers.

    python bench/slow_reward.py [--episodes 64] [--sleep 1.0] [--steps 2] [--workers 64]
    python bench/slow_reward.py --smoke     # 16 episodes, 0.1 s rewards
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SLEEP_S = 1.0


class SlowEnv:
    """Reverse a string; the reward takes SLEEP_S seconds (a slow verifier)."""

    def __init__(self, sleep_s: float = 1.0):
        self.sleep_s = sleep_s

    def sample_task(self, rng):
        from rlcli.envs import Task

        s = "".join(rng.choice("abcdef") for _ in range(rng.randint(3, 6)))
        return Task(prompt=f"{s}=", answer=s[::-1])

    def reward(self, task, completion):
        time.sleep(self.sleep_s)
        return float(completion.strip() == task.answer)


def write_recipe(tmp: Path, args, workers: int, run_dir: Path) -> Path:
    from rlcli.config import dump_toml

    groups = args.episodes // 4
    tree = {
        "name": "slow-reward", "seed": 0, "num_steps": args.steps, "run_dir": str(run_dir),
        "model": {"path": str(tmp / "model"), "max_seq_len": 32},
        "env": {"name": "slow_reward:SlowEnv", "args": {"sleep_s": args.sleep}, "num_workers": workers,
                "reward_timeout_s": 60.0},
        "infer": {"max_num_seqs": args.episodes, "engine": {"name": "native", "num_threads": 1,
                                                             "kv_cache_memory_mb": 32}},
        "train": {"micro_batch_tokens": 256},
        "orchestrate": {"batch_size": groups, "group_size": 4, "max_async": 1, "sampling": {"max_tokens": 8}},
    }
    path = tmp / f"recipe-{workers}.toml"
    path.write_text(dump_toml(tree))
    return path


def trainer_stand_in(run, stop: threading.Event) -> None:
    """Announce policy N once batch N is STABLE (no training: the loop is what is measured)."""
    while not stop.is_set():
        latest = run.latest_stable("rollouts") or 0
        if latest > int(run.read_progress("sync").get("version", 0)):
            run.write_progress("sync", version=latest)
        time.sleep(0.02)


def engine_sampler(endpoint: str, stop: threading.Event, samples: list) -> None:
    from rlcli.protocol import HealthRequest, HealthResponse
    from rlcli.transport.zmq import RpcClient, new_request_id

    client = RpcClient(endpoint)
    try:
        while not stop.is_set():
            reply = client.call(HealthRequest(request_id=new_request_id()), 5.0, peer="rl-infer")
            if isinstance(reply, HealthResponse):
                samples.append(reply.num_running + reply.num_waiting > 0)
            time.sleep(0.02)
    finally:
        client.close()


def run_mode(tmp: Path, args, workers: int, server_run: Path) -> dict:
    from rlcli.config import load_recipe
    from rlcli.orchestrate.loop import Orchestrator
    from rlcli.transport.registry import list_entries
    from rlcli.transport.rundir import RunDir

    run_dir = tmp / f"run-{workers}"
    shutil.copytree(server_run / "registry", run_dir / "registry")  # the same live server
    (run_dir / "progress").mkdir(parents=True)
    run = RunDir(run_dir)
    run.write_progress("sync", version=0)
    cfg = load_recipe(write_recipe(tmp, args, workers, run_dir))
    o = Orchestrator(cfg, run)
    stall = {"total": 0.0, "max": 0.0}

    def timed(fn):
        def wrapper(*a):
            t0 = time.monotonic()
            fn(*a)
            dt = time.monotonic() - t0
            stall["total"] += dt
            stall["max"] = max(stall["max"], dt)
        return wrapper

    o.on_reply, o.collect = timed(o.on_reply), timed(o.collect)
    stop, samples = threading.Event(), []
    endpoint = list_entries(server_run / "registry", "infer")[0].endpoints["rpc"]
    threads = [threading.Thread(target=trainer_stand_in, args=(run, stop), daemon=True),
               threading.Thread(target=engine_sampler, args=(endpoint, stop, samples), daemon=True)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    try:
        o.loop()
    finally:
        wall = time.monotonic() - t0
        stop.set()
        o.close()
    metrics = [json.loads(line) for line in (run_dir / "metrics" / "orchestrate.jsonl").read_text().splitlines()]
    return {"mode": "inline" if workers == 0 else f"{workers} workers", "stall_s": stall["total"],
            "longest_stall_s": stall["max"], "wall_s": wall, "engine_busy": sum(samples) / max(len(samples), 1),
            "episodes": sum(m["num_samples"] for m in metrics), "reward_mean": sum(m["reward_mean"] for m in metrics)
            / len(metrics)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64, help="episodes per batch (groups of 4)")
    p.add_argument("--sleep", type=float, default=1.0, help="seconds each reward call sleeps")
    p.add_argument("--steps", type=int, default=2, help="batches per mode")
    p.add_argument("--workers", type=int, default=64, help="env.num_workers of the worker mode")
    p.add_argument("--smoke", action="store_true", help="16 episodes, 0.1 s rewards, 1 step")
    args = p.parse_args()
    if args.smoke:
        args.episodes, args.sleep, args.steps, args.workers = 16, 0.1, 1, 16
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # slow_reward:SlowEnv

    from rlcli.models import load_model, save_model
    from rlcli.transport.atomic import atomic_dir
    from rlcli.transport.registry import list_entries

    tmp = Path(tempfile.mkdtemp(prefix="slow-reward-"))
    model = tmp / "model"
    model.mkdir()
    cfg = json.loads((REPO / "recipes" / "models" / "tiny-llama" / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg))
    shutil.copy(REPO / "recipes" / "models" / "tiny-llama" / "tokenizer_config.json", model)
    server_run = tmp / "server"
    with atomic_dir(server_run / "weights" / "step_0", {"step": 0}) as d:
        save_model(load_model(model, seed=0), d, source_dir=model)
    recipe = write_recipe(tmp, args, 0, server_run)
    log = open(tmp / "infer.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "rlcli.cli.infer", "serve", "--config", str(recipe), "--id", "0"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not list_entries(server_run / "registry", "infer"):
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"rl-infer did not start; see {tmp / 'infer.log'}")
            time.sleep(0.2)
        rows = [run_mode(tmp, args, 0, server_run), run_mode(tmp, args, args.workers, server_run)]
    finally:
        server.terminate()
        server.wait(30)
    print(f"reward sleeps {args.sleep}s per call; {args.steps} batches x {args.episodes} episodes per mode")
    print(f"{'mode':<12} {'stall_s':>9} {'longest_s':>10} {'wall_s':>8} {'engine_busy':>12} {'episodes':>9}")
    for r in rows:
        print(f"{r['mode']:<12} {r['stall_s']:9.2f} {r['longest_stall_s']:10.3f} {r['wall_s']:8.2f} "
              f"{r['engine_busy']:12.2f} {r['episodes']:9d}")
    inline, workers = rows
    print(f"ratio inline/workers: stall {inline['stall_s'] / workers['stall_s']:.1f}x, longest stall "
          f"{inline['longest_stall_s'] / workers['longest_stall_s']:.1f}x, wall {inline['wall_s'] / workers['wall_s']:.2f}x")
    print(json.dumps({"inline": inline, "workers": workers}))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
