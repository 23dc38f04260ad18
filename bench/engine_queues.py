"""The native engine's host-side cost at the demo's load: the working tree against a git ref.

The workload is the demo's in-flight generation (recipes/reverse.toml: two steps of 32 prompts x 16
completions at max_async 1, ~12 new tokens each) on its tiny Llama, one thread: 64 prompts, n = 16,
12 tokens, sampled. At that size the engine's step is mostly Python (scheduling, bookkeeping), so this
measures the scheduler and the queues, not the model. Each arm runs in its own process with its own
tree first on ``PYTHONPATH``, the arms alternating ``--repeats`` times; the best time of each counts.

    python bench/engine_queues.py --baseline eeef59b     # the ref checked out into a temporary worktree

The twenty-third session's fix it measured: ``Sequence`` / ``Request`` compared by identity, not field
by field (every ``seq in self.running`` was a deep compare: O(running^2) work per step).
"""

import argparse
import subprocess
import sys
from pathlib import Path

from _baseline import baseline_tree

REPO = Path(__file__).resolve().parents[1]

WORKLOAD = """
import sys, time
import torch
from rlcli.infer.engine import NativeEngine
from rlcli.models import load_model
from rlcli.protocol import GenerateRequest, SamplingParams

prompts, n, tokens = (int(x) for x in sys.argv[1:4])
torch.set_num_threads(1)
model = load_model(sys.argv[4], seed=0).eval()
engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, max_num_seqs=prompts * n, kv_cache_memory_mb=64)
for i in range(prompts):
    engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=[256] + [(i * 7 + j) % 250 for j in range(8)],
                                       sampling=SamplingParams(temperature=1.0, max_tokens=tokens, n=n, seed=i)))
t = time.perf_counter()
steps = 0
while engine.has_work():
    engine.step()
    steps += 1
print(time.perf_counter() - t, steps)
"""


def run(tree: Path, prompts: int, n: int, tokens: int) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", WORKLOAD, str(prompts), str(n), str(tokens),
                          str(REPO / "recipes" / "models" / "tiny-llama")],
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    seconds, steps = out.stdout.split()
    return float(seconds), int(steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="HEAD", help="git ref of the baseline arm [HEAD]")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="4 prompts x 4, one repeat, the working tree as both arms")
    args = p.parse_args()
    if args.smoke:
        args.prompts, args.n, args.repeats = 4, 4, 1
    with baseline_tree(args.baseline, same=args.smoke) as (base, label):
        best = {"baseline": float("inf"), "tree": float("inf")}
        for _ in range(args.repeats):
            for arm, tree in (("baseline", base), ("tree", REPO)):
                seconds, steps = run(tree, args.prompts, args.n, args.tokens)
                best[arm] = min(best[arm], seconds)
                print(f"{arm:<9} {seconds:7.3f} s  ({steps} engine steps)", flush=True)
    print(f"{args.prompts} prompts x {args.n} x {args.tokens} tokens: baseline ({label}) {best['baseline']:.3f} s, "
          f"working tree {best['tree']:.3f} s: {best['baseline'] / best['tree']:.2f}x")


if __name__ == "__main__":
    main()
