"""Synchronous vs asynchronous RL on a long-tailed workload, side by side.

Runs the same recipe (default: recipes/bench-longtail.toml) with every process live
through `rl-orchestrate up`: once with max_async = 0 (synchronous RL, the baseline) and
once per asynchronous setting (default max_async = 2; with ``--max-off-policy-steps``, once per
bound for each), then prints per mode the mean
trainer step time (time between consecutive trainer steps, after a warm-up), the
trainer's idle fraction (time waiting for batches / wall time), trained tokens per
second, the mean completion length of the trained batches against the generated ones,
the fraction of dispatched groups dropped for staleness, and the ratios against the
baseline. Step time and trained tokens/s must rise together: an asynchronous run that
were faster by training shorter completions would show it in the length ratio.

A synchronous step lasts as long as its batch's longest completion, which on a long-tailed
workload varies a lot from batch to batch, so the step-time ratio is printed with a 90% interval
from a moving-block bootstrap of each run's step times (blocks of 5 steps, which keeps the runs of
slow steps a straggler causes together); the default is 80 steps. The interval covers the
variation within the runs, not a machine whose speed drifts between them: on one H100 host the
same code gave 2.62x over 40 steps and 1.82x over 80 in another call (docs/benchmarks.md).

    python bench/async_vs_sync.py [--recipe recipes/bench-longtail.toml] [--steps 80] [--max-async 2 4]
                                  [--max-off-policy-steps 2 4] [--keep DIR]
                                  [recipe overrides for every mode, e.g. --infer.device cuda]
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from run_metrics import read_metrics as read
from run_metrics import run_up


def run_mode(recipe: Path, max_async: int, steps: int, run_dir: Path, extra: list[str] = ()) -> None:
    err = run_up(recipe, run_dir, ["--steps", str(steps), "--max-async", str(max_async), *extra])
    if err:
        sys.exit(f"max_async={max_async} failed: {err}")


def summarize(run_dir: Path, warmup: int) -> dict:
    train = read(run_dir, "train")[warmup:]
    orch = read(run_dir, "orchestrate")
    times = [m["time"] for m in train]
    intervals = [b - a for a, b in zip(times, times[1:])]
    step_s = statistics.fmean(intervals)
    wall = times[-1] - times[0]
    busy = sum(m["compute_s"] + m["save_s"] for m in train[1:])
    tokens = sum(m["num_loss_tokens"] for m in train[1:])
    return {
        "step_s": step_s,
        "step_intervals": intervals,
        "trainer_idle": max(0.0, 1 - busy / wall),
        "train_tokens_per_s": tokens / wall,
        "lag_max": max(m["off_policy_lag"] for m in train),
        "stale_dropped": sum(m["num_stale_dropped"] for m in orch),
        "redispatched": sum(m.get("num_redispatched", 0) for m in orch),
        "dispatched": sum(m.get("num_dispatched", 0) for m in orch),
        "completion_len_mean": statistics.fmean(m["completion_len_mean"] for m in orch[warmup:]),
        "generated_len_mean": statistics.fmean(m.get("generated_len_mean", 0.0) for m in orch[warmup:]),
    }


def ratio_interval(base: list[float], other: list[float], reps: int = 2000, block: int = 5,
                   seed: int = 0) -> tuple[float, float]:
    """5th and 95th percentiles of ``mean(base) / mean(other)`` over a moving-block bootstrap of
    each list (blocks of ``block`` consecutive values, drawn with replacement)."""
    rng = random.Random(seed)

    def mean_of_resample(x: list[float]) -> float:
        b = min(block, len(x))
        drawn: list[float] = []
        while len(drawn) < len(x):
            start = rng.randrange(len(x) - b + 1)
            drawn += x[start:start + b]
        return statistics.fmean(drawn[:len(x)])

    ratios = sorted(mean_of_resample(base) / mean_of_resample(other) for _ in range(reps))
    return ratios[int(0.05 * reps)], ratios[int(0.95 * reps) - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", type=Path, default=Path(__file__).resolve().parent.parent / "recipes" /
                   "bench-longtail.toml")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-async", type=int, nargs="+", default=[2])
    p.add_argument("--max-off-policy-steps", type=int, nargs="+", default=None,
                   help="Run each asynchronous mode once per bound (orchestrate.max_off_policy_steps) "
                        "instead of once with the default bound, max_async.")
    p.add_argument("--keep", type=Path, default=None, help="Keep the run directories under this folder.")
    args, extra = p.parse_known_args()  # the rest (recipe overrides) goes to every mode
    base = args.keep or Path(tempfile.mkdtemp(prefix="rlcli-bench-"))
    modes = [("max_async=0", 0, None)]
    for k in args.max_async:
        for bound in args.max_off_policy_steps or [None]:
            modes.append((f"max_async={k}" + (f",bound={bound}" if bound is not None else ""), k, bound))
    results = {}
    for name, k, bound in modes:
        run_dir = base / name.replace("=", "_").replace(",", "_")
        print(f"running {name} ({args.steps} steps) ...", file=sys.stderr, flush=True)
        bound_args = [] if bound is None else ["--max-off-policy-steps", str(bound)]
        run_mode(args.recipe, k, args.steps, run_dir, [*extra, *bound_args])
        results[name] = summarize(run_dir, args.warmup)
    sync = results["max_async=0"]
    width = max(14, *(len(name) + 2 for name in results))
    print(f"{'mode':<{width}}{'step s':>8}{'ratio':>7}{'idle':>7}{'tok/s':>8}{'ratio':>7}{'len':>6}{'ratio':>7}"
          f"{'gen len':>8}{'lag':>5}{'dropped':>9}{'resent':>8}")
    for name, r in results.items():
        dropped = r["stale_dropped"] / max(r["dispatched"], 1)
        print(f"{name:<{width}}{r['step_s']:>8.3f}{sync['step_s'] / r['step_s']:>6.2f}x"
              f"{r['trainer_idle']:>7.1%}{r['train_tokens_per_s']:>8.0f}"
              f"{r['train_tokens_per_s'] / sync['train_tokens_per_s']:>6.2f}x{r['completion_len_mean']:>6.1f}"
              f"{r['completion_len_mean'] / sync['completion_len_mean']:>6.2f}x{r['generated_len_mean']:>8.1f}"
              f"{r['lag_max']:>5d}{dropped:>9.1%}{r['redispatched']:>8d}")
    for name, r in results.items():
        if r is sync:
            continue
        lo, hi = r["step_ratio_interval"] = ratio_interval(sync["step_intervals"], r["step_intervals"])
        print(f"{name} vs sync: step time {sync['step_s'] / r['step_s']:.2f}x (90% interval "
              f"{lo:.2f}-{hi:.2f}x), trained tokens/s {r['train_tokens_per_s'] / sync['train_tokens_per_s']:.2f}x, "
              f"mean trained completion {r['completion_len_mean'] / sync['completion_len_mean']:.2f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
