"""An MoE layer's forward + backward: this tree against a baseline tree, side by side.

Times ``MoE.routed`` (sort by expert, the experts' grouped GEMMs, weight by the gates, sum per
token) plus the router, forward and backward, in bf16 on one GPU, for each arm in its own
process with its tree first on ``PYTHONPATH``: the same weights, inputs and routing in both.
Prints per layer shape the milliseconds per step of each arm, the ratio (above 1: this tree is
faster), and how far this tree's output and gradients are from the baseline's (relative to
the largest baseline value). ``--profile`` adds each arm's ops with the most device time. ``--ep``
runs the layer under rl-train's expert-parallel hooks (``rlcli.parallel.expert.apply_ep``) on a
one-rank process group (gloo on the CPU, NCCL on CUDA): the all-to-alls are copies, and the
dispatch's and combine's permutations run as with more ranks.

    python bench/moe_dispatch.py --baseline HEAD~1          # a git ref, checked out beside
    python bench/moe_dispatch.py --baseline-tree /tmp/base  # an unpacked tree (no .git on the machine)
    python bench/moe_dispatch.py --smoke                    # CPU, fp32, a tiny layer, the tree against itself
    python bench/moe_dispatch.py --ep ...                   # with the expert-parallel dispatch and combine

Torch only (plus ``rlcli.models`` and, with ``--ep``, ``rlcli.parallel`` from each tree).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _baseline import baseline_tree

SHAPES = {  # name: (hidden, experts, expert width, top-k)
    "qwen3-moe-1.8b": (2048, 32, 1024, 4),  # bench/fp8_train_step.py's MoE
    "qwen3-30b-a3b": (2048, 128, 768, 8),
    "tiny-qwen3-moe": (128, 8, 96, 2),  # recipes/reverse-moe.toml's model (the CPU loop)
}

WORKER = r"""
import json, sys, time
import torch
from rlcli.models.config import ModelArgs
from rlcli.models.moe import MoE

device, dtype, tokens, hidden, experts, width, topk, iters, profile, ep, out = sys.argv[1:]
device, dtype = torch.device(device), getattr(torch, dtype)
tokens, hidden, experts, width, topk, iters = map(int, (tokens, hidden, experts, width, topk, iters))
args = ModelArgs(model_type="qwen3_moe", vocab_size=1, hidden_size=hidden, intermediate_size=1, num_hidden_layers=1,
                 num_attention_heads=1, num_key_value_heads=1, head_dim=1, num_experts=experts,
                 num_experts_per_tok=topk, moe_intermediate_size=width, norm_topk_prob=True, moe_layers=[0])
layer = MoE(args, 0)
gen = torch.Generator().manual_seed(0)
with torch.no_grad():
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
layer = layer.to(device=device, dtype=dtype)
if ep == "1":  # the expert-parallel hooks on a one-rank group: the all-to-alls are copies, the permutations run
    import torch.distributed as dist
    from rlcli.parallel.expert import apply_ep
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1, store=dist.HashStore())
    apply_ep(layer, dist.group.WORLD)
x = (torch.randn(tokens, hidden, generator=gen)).to(device, dtype).requires_grad_(True)
dy = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
with torch.no_grad():
    idx = layer.gate.select(layer.gate.scores(x))  # fixed: both arms route alike

def step():
    scores = layer.gate.scores(x)
    y = layer.routed(x, idx, layer.gate.gates(scores, idx, x.dtype))
    y.backward(dy)
    return y

sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
for _ in range(3):
    step()
layer.zero_grad(set_to_none=True)
x.grad = None
sync()
times = []
for _ in range(iters):
    t0 = time.perf_counter()
    step()
    sync()
    times.append(time.perf_counter() - t0)
layer.zero_grad(set_to_none=True)
x.grad = None
y = step().detach()
grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
local = lambda g: g.to_local() if hasattr(g, "to_local") else g  # EP: DTensor gradients
torch.save({"y": y.float().cpu(), **{n: local(g).float().cpu() for n, g in grads.items()}}, out)
top = []
if profile == "1" and device.type == "cuda":
    from torch.profiler import ProfilerActivity, profile as prof
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        step()
        sync()
    ops = sorted(p.key_averages(), key=lambda e: -e.self_device_time_total)[:12]
    top = [(e.key, e.count, e.self_device_time_total / 1e3) for e in ops]
print(json.dumps({"ms": sorted(times)[len(times) // 2] * 1e3, "top": top}))
"""


def run_arm(tree: Path, device: str, dtype: str, tokens: int, shape, iters: int, profile: bool, ep: bool,
            out: Path) -> dict:
    env_path = str(tree)  # also the working directory: `python -c` puts it first on sys.path
    proc = subprocess.run([sys.executable, "-c", WORKER, device, dtype, str(tokens), *map(str, shape), str(iters),
                           "1" if profile else "0", "1" if ep else "0", str(out)], capture_output=True, text=True,
                          cwd=env_path,
                          env={**os.environ, "PYTHONPATH": env_path})
    if proc.returncode != 0:
        raise SystemExit(f"the arm in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="HEAD", help="git ref of the baseline arm")
    ap.add_argument("--baseline-tree", type=Path, default=None, help="an unpacked baseline tree instead")
    ap.add_argument("--shapes", default="qwen3-moe-1.8b,qwen3-30b-a3b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="each arm's ops with the most device time")
    ap.add_argument("--ep", action="store_true",
                    help="with rl-train's expert-parallel hooks (rlcli.parallel.expert) on a one-rank group")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, a tiny layer, the tree against itself")
    args = ap.parse_args()
    import torch

    device, dtype = ("cuda", "bfloat16") if torch.cuda.is_available() and not args.smoke else ("cpu", "float32")
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    if args.smoke:
        args.tokens, args.iters, shapes = 256, 3, {"tiny": (64, 8, 32, 2)}
    tree = Path(__file__).resolve().parents[1]
    print(f"# MoE layer forward + backward{', expert-parallel hooks (one rank)' if args.ep else ''}, {device} {dtype}, "
          f"{args.tokens} tokens, median of {args.iters} steps")
    with baseline_tree(args.baseline, args.baseline_tree, same=args.smoke) as (base, label), \
            tempfile.TemporaryDirectory() as tmp:
        print(f"# baseline: {label}")
        print(f"{'layer':<16} {'baseline ms':>12} {'tree ms':>9} {'ratio':>7}  {'max rel diff (output, worst grad)':>34}")
        for name, shape in shapes.items():
            res = {}
            for arm, root in (("baseline", base), ("tree", tree)):
                res[arm] = run_arm(root, device, dtype, args.tokens, shape, args.iters, args.profile, args.ep,
                                   Path(tmp) / f"{arm}.pt")
            a, b = torch.load(Path(tmp) / "baseline.pt"), torch.load(Path(tmp) / "tree.pt")
            rel = {k: ((b[k] - a[k]).abs().max() / a[k].abs().max().clamp(min=1e-30)).item() for k in a}
            worst = max((k for k in rel if k != "y"), key=rel.get)
            ratio = res["baseline"]["ms"] / res["tree"]["ms"]
            print(f"{name:<16} {res['baseline']['ms']:>12.2f} {res['tree']['ms']:>9.2f} {ratio:>6.2f}x  "
                  f"{rel['y']:>11.1e}, {rel[worst]:.1e} ({worst})")
            for arm in ("baseline", "tree"):
                for op, count, ms in res[arm]["top"]:
                    print(f"    {arm:<8} {ms:8.2f} ms {count:5d}x  {op[:90]}")


if __name__ == "__main__":
    main()
