"""Where an RL step's time goes, read off a finished (or running) run directory.

Per step, from RUN/metrics and RUN/logs: the orchestrator's step time (dispatch to batch
written) and generated tokens/s; the trainer's wait for the batch, its compute (logprob
recompute, loss, backward, optimizer) and its save of the new weights; rl-infer's
in-flight weight load (``loaded policy vN in Xs`` lines of its log). Mean and median over
the steps after ``--skip`` warm-up steps; also reward first/last 5 and the engine used.

    python bench/rl_step_breakdown.py RUN_DIR [--skip 2]

On the GPU (SmolLM2-shaped policy, rl-infer on vLLM and rl-train on one GPU; bench/README.md
says how vLLM gets there): ``rl-orchestrate up recipes/smollm2-reverse.toml --engine vllm``, then
this script on its run directory.
"""

import argparse
import statistics
import tomllib
from pathlib import Path

from run_metrics import infer_load_times, jsonl


def row(name: str, values: list[float], unit: str = "s") -> str:
    if not values:
        return f"{name:<34} {'-':>9} {'-':>9} {0:>5}"
    return f"{name:<34} {statistics.mean(values):>8.3f}{unit} {statistics.median(values):>8.3f}{unit} {len(values):>5}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    a = ap.parse_args()
    orch = [r for r in jsonl(a.run / "metrics" / "orchestrate.jsonl") if r["step"] > a.skip]
    train = [r for r in jsonl(a.run / "metrics" / "train.jsonl") if r["step"] > a.skip]
    loads = infer_load_times(a.run)[a.skip:]
    engine = "?"
    cfg = a.run / "config" / "infer-0.toml"
    if cfg.is_file():
        infer = tomllib.loads(cfg.read_text()).get("infer", {})
        engine = f"{infer.get('engine', {}).get('name', '?')} on {infer.get('device', '?')}"
    print(f"rl_step_breakdown: {a.run} (rl-infer: {engine}), steps after {a.skip}")
    print(f"{'':<34} {'mean':>9} {'median':>9} {'n':>5}")
    print(row("orchestrator step (rollouts)", [r["step_s"] for r in orch]))
    print(row("trainer wait for batch", [r["wait_s"] for r in train]))
    print(row("trainer compute", [r["compute_s"] for r in train]))
    print(row("trainer save weights", [r["save_s"] for r in train]))
    print(row("rl-infer weight load (in flight)", loads))
    print(row("generated tokens/s", [r["tokens_per_s"] for r in orch], " "))
    times = [r["time"] for r in train]
    if len(times) > 1:
        print(f"{'trainer step period':<34} {(times[-1] - times[0]) / (len(times) - 1):>8.3f}s")
    rewards = [r["reward_mean"] for r in jsonl(a.run / "metrics" / "orchestrate.jsonl")]
    if len(rewards) >= 10:
        print(f"reward first 5 {statistics.mean(rewards[:5]):.3f} last 5 {statistics.mean(rewards[-5:]):.3f} "
              f"over {len(rewards)} steps")


if __name__ == "__main__":
    main()
