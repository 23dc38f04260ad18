"""Where the host time of an eager FP8 training step goes, against bf16: cProfile of a few steps.

    python3 bench/fp8_host_profile.py            # H200: the 1.1B dense Llama, 8,192 tokens a step
    python bench/fp8_host_profile.py --smoke     # CPU: the tiny dense model, emulated FP8

Builds bench/fp8_train_step.py's dense model twice (bf16, and FP8 with q/k/v stacked as rl-train does),
runs warm-up steps, then prints per arm the host time to enqueue one step against its wall time (host
close to wall: host-bound), and the Python functions with the most own and cumulative time over
``--steps`` profiled steps (cProfile adds ~1 us to every Python call, so small functions look dearer than
they are). Last, ``host_costs``: host us per call of each FP8 piece without the profiler.
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_train_step import DENSE_1B, SMOKE_DENSE, batches, build_arm, host_costs, make_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per arm")
    ap.add_argument("--top", type=int, default=28)
    a = ap.parse_args()
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    hf = SMOKE_DENSE if a.smoke else DENSE_1B
    batch, seq = (2, 64) if a.smoke else (4, 2048)
    data = batches(hf["vocab_size"], batch, seq + 1, 4, seed=1)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for arm in ("bf16", "fp8"):
        model, _ = build_arm(hf, arm, "auto", dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if dev.type == "cuda" else {}))
        run, _ = make_step(model, opt, False, data, dev)
        ids = [d.to(dev) for d in data]
        for i in range(4):  # DeepGEMM compiles its kernels and the wgrad pick measures in the first steps
            run(ids[i % len(ids)])
            sync()
        t0 = time.perf_counter()
        run(ids[0])
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        print(f"{arm}: host {1e3 * (t1 - t0):.1f} ms to enqueue a step, wall {1e3 * (t2 - t0):.1f} ms", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for i in range(a.steps):
            run(ids[i % len(ids)])
        sync()
        prof.disable()
        stats = pstats.Stats(prof, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(a.top)
        if arm == "fp8":
            stats.sort_stats("cumtime").print_stats("rlcli|triton|functional", a.top)
        del model, opt, run
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    M, K = batch * seq, hf["hidden_size"]
    print(f"host us per call ({M} tokens, {K}x{K} weight, no profiler)")
    for name, us in host_costs("auto", dev, M, K, K, calls=20 if dev.type == "cuda" else 2):
        print(f"  {us:8.1f}  {name}")


if __name__ == "__main__":
    main()
