"""SwiGLU's gate, forward + backward: rlcli's fused kernels against torch's ops, side by side.

    python3 bench/swiglu.py            # a GPU with Triton

For each ``[rows, width]`` shape (an MoE layer's expert rows, a dense MLP's tokens) and dtype, times
``h = silu(g) * u`` and ``h.backward(dh)`` through ``rlcli.ops.swiglu.SwiGLUFn`` (one kernel each
way) and through autograd over ``F.silu(g) * u`` (torch's: two kernels forward, three backward), as
back-to-back calls between two CUDA events (at these sizes each kernel takes far longer than its
launch), alternating the arms, and prints the median microseconds per call
of each, the ratio (above 1: the kernels are faster), the memory the forward keeps for the backward,
and whether the output and both gradients are equal to the bit.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # rlcli from this tree

from rlcli.ops import swiglu  # noqa: E402

SHAPES = {  # name: (rows, width)
    "moe-1.8b-experts-32k-top4": (131072, 1024),
    "qwen3-30b-a3b-experts-32k-top8": (262144, 768),
    "llama-1b-mlp-8k": (8192, 8192),
    "qwen3-8b-mlp-16k": (16384, 12288),
}


def _torch(g, u):
    return F.silu(g) * u


def _step(fn, g, u, dh):
    def run():
        torch.autograd.grad(fn(g, u), (g, u), dh)
    return run


def _us(fns: dict, calls: int, repeats: int) -> dict:
    """Median microseconds per call of each of ``fns``, the arms alternating (warmed up first)."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) * 1e3 / calls)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def _kept(fn, g, u) -> int:
    """Bytes the forward keeps for the backward, beyond its output."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    h = fn(g, u)
    kept = torch.cuda.memory_allocated() - before - h.numel() * h.element_size()
    del h
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of: {', '.join(SHAPES)}")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--calls", type=int, default=5, help="calls per timed run")
    ap.add_argument("--runs", type=int, default=10, help="timed runs of --calls calls per arm")
    a = ap.parse_args()
    if not torch.cuda.is_available() or swiglu._kernels() is None:
        sys.exit("bench/swiglu.py needs CUDA and Triton")
    print(f"# SwiGLU forward + backward, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"us per call, median of {a.runs} runs of {a.calls} calls", flush=True)
    print(f"{'shape':<42} {'dtype':<9} {'torch us':>9} {'fused us':>9} {'ratio':>6} {'kept MB (torch, fused)':>23} "
          "bitwise", flush=True)
    for name in a.shapes.split(","):
        rows, width = SHAPES[name]
        for dtype in [getattr(torch, d) for d in a.dtypes.split(",")]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            g, u, dh = [torch.randn(rows, width, device="cuda", generator=gen, dtype=dtype) * 3 for _ in range(3)]
            g.requires_grad_()
            u.requires_grad_()
            outs = {}
            for arm, fn in (("torch", _torch), ("fused", swiglu.SwiGLUFn.apply)):
                g.grad = u.grad = None
                h = fn(g, u)
                h.backward(dh)
                outs[arm] = (h.detach(), g.grad.clone(), u.grad.clone())
            same = all(torch.equal(x, y) for x, y in zip(outs["torch"], outs["fused"]))
            us = _us({arm: _step(fn, g, u, dh) for arm, fn in (("torch", _torch), ("fused", swiglu.SwiGLUFn.apply))},
                     a.calls, a.runs)
            kept = {arm: _kept(fn, g, u) / 2**20 for arm, fn in (("torch", _torch), ("fused", swiglu.SwiGLUFn.apply))}
            print(f"{name:<42} {str(dtype).removeprefix('torch.'):<9} {us['torch']:9.1f} {us['fused']:9.1f} "
                  f"{us['torch'] / us['fused']:5.2f}x {kept['torch']:11.0f} {kept['fused']:11.0f} {'yes' if same else 'NO'}",
                  flush=True)
            del g, u, dh, outs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
