"""The native engine's first steps on a fresh machine: the working tree against a baseline tree.

Each arm runs in its own process with an empty Triton cache (``TRITON_CACHE_DIR``), as rl-infer
does on a node that never ran it: it builds an engine for #9's micro Llama (random weights,
``max_model_len`` 4,096) and then serves seven waves, one joining every 3 steps: 4 prompts of 1,500
tokens in all (decodes whose keys split over spans) and 64 prompts of 16 tokens with n = 4 (whole
decodes), 24 new tokens each, so the step's table width, span count and table alignment keep
changing. It reports the engine's construction (where the working tree's ``NativeEngine.warm_up``
compiles the paged decode kernel), the first 10 steps, the longest step, the steady median
(steps 30 on), and how many variants of the kernel and of its merge Triton compiled.

The baseline is a tree before the warm-up (its first steps compile) or, without
``--baseline-tree``, the working tree with ``NativeEngine.warm_up`` switched off.

    python bench/engine_warm_up.py --baseline-tree /tmp/base   # an unpacked tree (git archive REF | tar -x -C DIR)
    python bench/engine_warm_up.py                             # the working tree without its warm-up
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORKLOAD = """
import json, statistics, sys, time
import torch
from rlcli.infer.engine import NativeEngine
from rlcli.models import load_model
from rlcli.protocol import GenerateRequest, SamplingParams

model_dir, dtype, no_warm_up = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3] == "1"
if no_warm_up:
    NativeEngine.warm_up = lambda self: None
model = load_model(model_dir, seed=0).eval().to("cuda", dtype)
torch.ones(1, device="cuda").sum().item()  # the CUDA context, outside every timing
t0 = time.perf_counter()
engine = NativeEngine(model, eos_token_ids=[], max_model_len=4096, max_num_seqs=512, kv_cache_memory_mb=512,
                      max_num_batched_tokens=4096)
torch.cuda.synchronize()
construct = time.perf_counter() - t0
waves = [[1500] * 2, [16] * 16, [16] * 16, [1500], [16] * 16, [16] * 16, [1500]]
steps, n = [], 0
while waves or engine.has_work():
    if waves and len(steps) % 3 == 0:
        for length in waves.pop(0):
            engine.add_request(GenerateRequest(request_id=str(n), prompt_ids=[(n * 7 + j) % 250 for j in range(length)],
                                               sampling=SamplingParams(temperature=1.0, max_tokens=24, n=1 if length > 16 else 4,
                                                                       ignore_eos=True)))
            n += 1
    t = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    steps.append(time.perf_counter() - t)
from rlcli.ops import paged_decode as K
variants = [sum(len(c[0]) for c in k.device_caches.values()) for k in (K._paged_decode_kernel, K._merge_spans_kernel)]
print(json.dumps({"construct_s": construct, "first10_s": sum(steps[:10]), "max_step_s": max(steps),
                  "median_step_s": statistics.median(steps[30:]), "steps": len(steps), "variants": variants}))
"""


def run(tree: Path, dtype: str, no_warm_up: bool) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        # The tree first; then the caller's path, where packages carried to a machine may be (/tmp/site).
        env = {**os.environ, "TRITON_CACHE_DIR": cache,
               "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
        out = subprocess.run([sys.executable, "-c", WORKLOAD, str(REPO / "recipes" / "models" / "micro-llama"), dtype,
                              "1" if no_warm_up else "0"], env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="an unpacked tree as the baseline (default: the working tree without its warm-up)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    label = str(args.baseline_tree) if args.baseline_tree else "working tree, warm_up off"
    base = args.baseline_tree.resolve() if args.baseline_tree else REPO
    rows = []
    for _ in range(args.repeats):
        rows.append((run(base, args.dtype, args.baseline_tree is None), run(REPO, args.dtype, False)))
    print(f"# native engine's first steps with an empty Triton cache, micro Llama {args.dtype}; baseline: {label}")
    print(f"{'':10} {'construct s':>12} {'first 10 steps s':>17} {'longest step s':>15} {'median step ms':>15} "
          f"{'variants (kernel, merge)':>25}")
    for base_r, tree_r in rows:
        for name, r in (("baseline", base_r), ("tree", tree_r)):
            print(f"{name:10} {r['construct_s']:12.3f} {r['first10_s']:17.3f} {r['max_step_s']:15.3f} "
                  f"{r['median_step_s'] * 1e3:15.2f} {str(r['variants']):>25}")
        b = base_r["construct_s"] + base_r["first10_s"]
        t = tree_r["construct_s"] + tree_r["first10_s"]
        print(f"construction + first 10 steps: {b / t:.2f}x faster; first 10 steps alone: "
              f"{base_r['first10_s'] / tree_r['first10_s']:.2f}x; longest step {base_r['max_step_s'] / tree_r['max_step_s']:.2f}x")


if __name__ == "__main__":
    main()
