"""Reward against wall-clock time: the demo under synchronous and asynchronous RL, side by side.

Runs a recipe (default: recipes/reverse.toml, the demo) through `rl-orchestrate up` twice
with the same seed: once with max_async = 0 (synchronous RL, the baseline) and once with
max_async = k (default: the recipe's own). Time is measured from the moment the first RL
batch's requests go out (the SFT warm-up and process start-up are the same in both and
excluded; before the sixth session the start-up, ~18 s on a quiet CPU, was counted in both). It
prints the final reward of each (mean of the last 5 steps), the time the asynchronous
run took to first reach the synchronous run's final reward (5-step moving mean), and the
ratio of that time to the synchronous run's total, and its two factors: async's median step against
sync's, and the step at which async got there (or its best moving mean). With several seeds (``--seeds 0,1,2``)
each seed runs both arms in turn (sync, then async), and the per-seed ratios are printed
with their median. ``--parallel`` runs every (seed, arm) at once instead, each pinned to its own
equal slice of the cores this process may use (at least 3 each): on a many-core host the arms
then neither wait for nor compete with each other, and the processes of one run (rl-infer,
rl-train, the orchestrator) do not share a core as they do on two. ``--async-steps N`` lets the
asynchronous run go on past sync's last step, to N steps: both arms then run with
``train.schedule_steps`` at sync's step count, so they follow the same learning-rate and entropy
schedules, and the asynchronous run holds their last values after it.

    python bench/reward_vs_time.py [--recipe recipes/reverse.toml] [--seeds 0,1,2] [--max-async 1] [--keep DIR] [--parallel]
                                   [--async-steps N]
                                   [recipe overrides for both arms, e.g. --sync.backend.kind async_filesystem]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

from run_metrics import read_metrics, run_up

from rlcli.config import load_recipe

WINDOW = 5


ARMS = ("sync", "async")
MIN_CORES = 3  # rl-infer and rl-train one each, the orchestrator and rl-sync the third


def run_mode(recipe: Path, seed: int, max_async: int | None, run_dir: Path, steps: int | None,
             extra: list[str] = ()) -> str:
    """One arm's run; what went wrong ("" when nothing did)."""
    args = ["--seed", str(seed)]
    if max_async is not None:
        args += ["--max-async", str(max_async)]
    if steps:
        args += ["--steps", str(steps)]
    err = run_up(recipe, run_dir, args + list(extra))
    return f"seed {seed}, max_async={max_async} failed: {err}" if err else ""


def arm_steps(args, arm: str) -> int | None:
    """RL steps of one arm: ``--async-steps`` for the asynchronous one where given, else ``--steps``."""
    return args.async_steps if arm == "async" and args.async_steps else args.steps


def seed_dir(base: Path, seed: int, several: bool) -> Path:
    """Where one seed's two arms run: ``base`` itself for a single seed, ``base/seed<N>`` for several."""
    return base / f"seed{seed}" if several else base


def run_all_parallel(args, seeds: list[int], base: Path) -> None:
    """Every (seed, arm) at once, each on its own slice of this process's cores."""
    runs = [(seed, arm) for seed in seeds for arm in ARMS]
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // len(runs)
    if per < MIN_CORES:
        sys.exit(f"--parallel needs {MIN_CORES} cores per run: {len(runs)} runs, {len(cores)} cores; "
                 f"give fewer --seeds or drop --parallel")
    errors: list[str] = []

    def one(i: int, seed: int, arm: str) -> None:
        # CPU affinity is per thread on Linux and a child inherits its forking thread's: this thread's
        # run, and every process it starts, stays on these cores.
        os.sched_setaffinity(0, cores[i * per:(i + 1) * per])
        k = 0 if arm == "sync" else args.max_async
        try:
            err = run_mode(args.recipe, seed, k, seed_dir(base, seed, len(seeds) > 1) / arm, arm_steps(args, arm),
                           args.extra)
        except Exception as e:  # a thread's exception would otherwise only be printed, and the bench go on
            err = f"seed {seed}, {arm}: {e!r}"
        if err:
            errors.append(err)

    print(f"running {len(runs)} runs at once, {per} cores each ...", file=sys.stderr, flush=True)
    threads = [threading.Thread(target=one, args=(i, *r)) for i, r in enumerate(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        sys.exit("\n".join(errors))


def curve(run_dir: Path) -> list[tuple[float, float]]:
    """(seconds since the first batch's requests went out, 5-step moving mean reward) per step."""
    rows = read_metrics(run_dir, "orchestrate")
    # The first step's wait_s is the start-up (servers, SFT warm-up, policy 0) before its first dispatch.
    t0 = rows[0]["time"] - (rows[0]["step_s"] - rows[0]["wait_s"])
    out = []
    for i, m in enumerate(rows):
        window = rows[max(0, i - WINDOW + 1):i + 1]
        out.append((m["time"] - t0, statistics.fmean(w["reward_mean"] for w in window)))
    return out


def breakdown(run_dir: Path) -> dict[str, float]:
    """Median seconds per step after the first 20 (start-up excluded): the orchestrator's step and the
    trainer's wait for its batch, compute, weight publish and checkpoint (on the trainer's thread)."""
    rows, orch = read_metrics(run_dir, "train"), read_metrics(run_dir, "orchestrate")
    rows, orch = rows[20:] or rows, orch[20:] or orch
    out = {"step": statistics.median(m["step_s"] for m in orch)}
    for key in ("wait_s", "compute_s", "publish_s", "checkpoint_s", "save_s"):
        if key in rows[0]:
            out[key.removesuffix("_s")] = statistics.median(m[key] for m in rows)
    return out


def compare(args, seed: int, base: Path, ran: bool = False) -> dict:
    """Both arms of one seed (run here in turn unless ``ran``): their table rows and the ratio."""
    curves = {}
    for name in ARMS:
        if not ran:
            print(f"seed {seed}: running {name} ...", file=sys.stderr, flush=True)
            err = run_mode(args.recipe, seed, 0 if name == "sync" else args.max_async, base / name,
                           arm_steps(args, name), args.extra)
            if err:
                sys.exit(err)
        curves[name] = curve(base / name)
    sync, asyn = curves["sync"], curves["async"]
    target, sync_total = sync[-1][1], sync[-1][0]
    reached = next((t for t, r in asyn if r >= target), None)
    print(f"seed {seed}")
    print(f"{'mode':<8}{'steps':>7}{'wall s':>9}{'first reward':>14}{'final reward':>14}")
    for name, c in curves.items():
        print(f"{name:<8}{len(c):>7}{c[-1][0]:>9.1f}{c[min(WINDOW, len(c)) - 1][1]:>14.3f}{c[-1][1]:>14.3f}")
    parts = {name: breakdown(base / name) for name in curves}
    for name, b in parts.items():
        print(f"  {name} median s/step: " + ", ".join(f"{k} {v:.3f}" for k, v in b.items()))
    ratio = reached / sync_total if reached is not None else None
    if reached is None:
        print(f"async never reached sync's final reward {target:.3f}")
    else:
        print(f"async reached sync's final reward {target:.3f} after {reached:.1f}s = "
              f"{ratio:.2f}x of sync's {sync_total:.1f}s (goal <= 0.5x)")
    # The ratio is about (async's step / sync's) x (async's steps to the target / sync's steps): speed and
    # learning per step, printed apart so that a miss names which of the two it was.
    speed = parts["async"]["step"] / parts["sync"]["step"]
    steps_to = next((i + 1 for i, (_, r) in enumerate(asyn) if r >= target), None)
    best = max(r for _, r in asyn)
    print(f"  factors: async's step {speed:.2f}x of sync's; async "
          + (f"at sync's final reward after {steps_to} steps, sync's run {len(sync)}" if steps_to is not None else
             f"best {best:.3f} against {target:.3f} in {len(asyn)} steps"))
    return {"seed": seed, "target": target, "sync_s": sync_total, "async_s": asyn[-1][0], "async_reached_s": reached,
            "ratio": ratio, "step_ratio": speed, "async_steps_to_target": steps_to, "async_best": best,
            "breakdown": parts, "curves": {k: [[round(t, 2), round(r, 4)] for t, r in c] for k, c in curves.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", type=Path, default=Path(__file__).resolve().parent.parent / "recipes" / "reverse.toml")
    p.add_argument("--seeds", default=None, help="Comma-separated seeds, e.g. 0,1,2 [--seed].")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-async", type=int, default=None, help="The asynchronous run's max_async [recipe's].")
    p.add_argument("--steps", type=int, default=None, help="RL steps [recipe's num_steps].")
    p.add_argument("--keep", type=Path, default=None, help="Keep the run directories under this folder.")
    p.add_argument("--parallel", action="store_true",
                   help=f"Run every seed and arm at once, each pinned to its own slice of the cores (>= {MIN_CORES} each).")
    p.add_argument("--async-steps", type=int, default=None,
                   help="The asynchronous run's RL steps, past sync's; both arms' schedules end at sync's last step.")
    args, args.extra = p.parse_known_args()  # the rest (recipe overrides: --sync.backend.kind ...) goes to both arms
    if args.async_steps:
        args.extra += ["--train.schedule_steps", str(args.steps or load_recipe(args.recipe).num_steps)]
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    base = args.keep or Path(tempfile.mkdtemp(prefix="rlcli-reward-"))
    if args.parallel:
        run_all_parallel(args, seeds, base)
    results = [compare(args, seed, seed_dir(base, seed, len(seeds) > 1), ran=args.parallel) for seed in seeds]
    ratios = [r["ratio"] for r in results]
    if len(seeds) > 1:
        print(f"{'seed':<6}{'sync s':>9}{'async s':>9}{'target':>9}{'reached s':>11}{'ratio':>8}"
              f"{'step x':>8}{'at step':>9}")
        for r in results:
            reached = f"{r['async_reached_s']:.1f}" if r["async_reached_s"] is not None else "never"
            ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
            at = str(r["async_steps_to_target"]) if r["async_steps_to_target"] is not None else "-"
            print(f"{r['seed']:<6}{r['sync_s']:>9.1f}{r['async_s']:>9.1f}{r['target']:>9.3f}{reached:>11}{ratio:>8}"
                  f"{r['step_ratio']:>8.2f}{at:>9}")
        # A seed whose async arm never reached the target counts as infinitely slow.
        med = statistics.median([x if x is not None else float("inf") for x in ratios])
        shown = f"{med:.2f}x" if med != float("inf") else "never reached (most seeds)"
        print(f"median ratio over seeds {','.join(map(str, seeds))}: {shown} (goal <= 0.5x)")
    print(json.dumps({"seeds": results} if len(seeds) > 1 else results[0]))


if __name__ == "__main__":
    main()
