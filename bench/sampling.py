"""The sampler's draw (rlcli.ops.sampling.sample) by batch size: the working tree against a baseline tree.

Each arm runs in its own process with its tree first on ``PYTHONPATH``: ``--rows`` batches of logits
over ``--vocab`` tokens (Qwen3's 151,936 by default) at temperature 1, from the same seeded
generator, timed over ``--iters`` calls after a warm-up; the best of ``--repeats`` alternating runs
counts. Each arm also returns its tokens and logprobs at the first batch size, and the bench prints
how many tokens the arms share (the same uniforms: they differ only where one falls within
rounding of a boundary between two tokens) and the largest logprob gap.

``--top-p P`` (< 1) draws from each row's nucleus instead. Random logits of scale 3 spread a row's mass
over thousands of tokens, where a language model's rarely does: ``--logit-scale`` sets the scale of
the random logits (7: ~1.9 nats of entropy, a nucleus of tens of tokens at 0.95; 3: ~6.5 nats, thousands).

    python bench/sampling.py --device cuda --baseline HEAD~1
    python bench/sampling.py --device cuda --baseline-tree /tmp/base    # an unpacked tree (no .git on the machine)
    python bench/sampling.py --top-p 0.95 --logit-scale 7 --rows 16,64 --iters 5   # the nucleus, on the CPU
    python bench/sampling.py --smoke                                    # CPU, the working tree as both arms
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _baseline import baseline_tree

REPO = Path(__file__).resolve().parents[1]

WORKLOAD = """
import json, sys, time
import torch
from rlcli.ops.sampling import sample

device, dtype, vocab, iters = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows = [int(r) for r in sys.argv[5].split(",")]
p, scale = float(sys.argv[6]), float(sys.argv[7])
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
out, first = {}, None
for S in rows:
    logits = (torch.randn(S, vocab, generator=torch.Generator().manual_seed(S)) * scale).to(device, dtype)
    temps, top_p = torch.ones(S, device=device), torch.full((S,), p, device=device)
    gen = torch.Generator(device).manual_seed(0)
    tok, lp = sample(logits, temps, top_p, gen, any_top_p=p < 1, greedy_rows="none")
    if first is None:
        first = (tok.tolist(), lp.tolist())
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        sample(logits, temps, top_p, gen, any_top_p=p < 1, greedy_rows="none")
    sync()
    out[S] = (time.perf_counter() - t) / iters * 1e3
print(json.dumps({"ms": out, "first": first}))
"""


def run(tree: Path, args) -> dict:
    env = {"PYTHONPATH": os.pathsep.join([str(tree), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]),
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", WORKLOAD, args.device, args.dtype, str(args.vocab), str(args.iters),
                          args.rows, str(args.top_p), str(args.logit_scale)],
                         env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="HEAD", help="git ref of the baseline arm [HEAD]")
    p.add_argument("--baseline-tree", type=Path, default=None, help="an unpacked tree as the baseline instead")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", default="16,64,256,512", help="comma-separated batch sizes")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--top-p", type=float, default=1.0, help="every row's top-p [1: none]")
    p.add_argument("--logit-scale", type=float, default=3.0, help="standard deviation of the random logits [3]")
    p.add_argument("--smoke", action="store_true", help="CPU, a small vocabulary, the working tree as both arms")
    args = p.parse_args()
    if args.smoke:
        args.device, args.vocab, args.rows, args.iters, args.repeats = "cpu", 1000, "4,16", 3, 1
    with baseline_tree(args.baseline, args.baseline_tree, same=args.smoke) as (base, label):
        best: dict[str, dict[str, float]] = {"baseline": {}, "tree": {}}
        first = {}
        for _ in range(args.repeats):
            for arm, tree in (("baseline", base), ("tree", REPO)):
                res = run(tree, args)
                first[arm] = res["first"]
                for s, ms in res["ms"].items():
                    best[arm][s] = min(best[arm].get(s, float("inf")), ms)
    print(f"# sample(), ms per call, {args.device} {args.dtype}, vocabulary {args.vocab}, temperature 1, "
          f"top-p {args.top_p:g}, logits of scale {args.logit_scale:g}; baseline: {label}")
    print(f"{'rows':>6} {'baseline':>9} {'tree':>9} {'ratio':>7}")
    for s in best["tree"]:
        b, t = best["baseline"][s], best["tree"][s]
        print(f"{s:>6} {b:>9.3f} {t:>9.3f} {b / t:>6.2f}x")
    (bt, bl), (tt, tl) = first["baseline"], first["tree"]
    same = sum(a == b for a, b in zip(bt, tt))
    gap = max(abs(a - b) for a, b in zip(bl, tl))
    print(f"first batch: {same}/{len(bt)} tokens equal, largest logprob gap {gap:.2e}")


if __name__ == "__main__":
    main()
