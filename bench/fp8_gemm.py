"""FP8 block-scaled GEMM throughput per backend on DeepSeek-V3 layer shapes, against bf16.

    python bench/fp8_gemm.py            # on an H200 (DeepGEMM from .dg/ if present)
    python bench/fp8_gemm.py --smoke    # tiny shapes on the CPU (emulated backend only)

For every shape and backend (deep_gemm, torch scaled_mm, emulated on CPU) it quantizes
the operands once with rlcli.ops.fp8.quant, checks the backend's output against a
dequantized fp32 reference of the *same* FP8 operands (relative Frobenius error; bf16
output rounding alone gives ~2e-3), and times the GEMM alone (no quantization):
TFLOP/s = 2*M*N*K / time. The bf16 baseline multiplies the unquantized operands
(torch.mm, or one grouped_mm / a loop for grouped shapes). Kinds:
  fwd     x [M, K] 1x128  @ W [N, K]^T 128x128   (forward and input gradient)
  wgrad   dy^T 1x128 @ x^T 1x128 along tokens    (weight gradient: scaled_mm, or DeepGEMM's 1D1D where the
                                                  deep_gemm backend measured it faster; both printed alone)
  grouped G experts, tokens sorted by expert, W [G, N, K] 128x128
  groupedx the same from bf16 rows (grouped_gemm_x: DeepGEMM quantizes them into its padded layout)
The torch backend's grouped GEMM is the Triton kernel of rlcli.ops.fp8.grouped_triton; "torch loop" is
the loop of scaled_mm over the groups it replaced (one host sync, each group padded to 128 rows), and
``--tiles 128x8x3,64x4x3`` adds the Triton kernel at each (rows a tile, warps, stages) on the grouped
shapes, and ``--baseline-tree DIR`` the Triton kernel of another tree's rlcli/ops/fp8/grouped_triton.py
(an unpacked checkout), on the same operands.
Needs torch only (+ DeepGEMM for that backend): imports rlcli.ops.fp8, no msgspec/zmq.
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if os.path.isdir(os.path.join(ROOT, ".dg")):
    sys.path.insert(0, os.path.join(ROOT, ".dg"))

from rlcli.ops.fp8.backends import (  # noqa: E402
    DeepGemmBackend, EmulatedBackend, TorchScaledMMBackend, import_deep_gemm,
)
from rlcli.ops.fp8 import grouped_triton  # noqa: E402
from rlcli.ops.fp8.quant import quantize_1x128, quantize_128x128  # noqa: E402

# DeepSeek-V3 (hidden 7168): (name, M, N, K); M = tokens
DENSE = [
    ("q_a_proj 7168->1536", 4096, 1536, 7168),
    ("q_b_proj 1536->24576", 4096, 24576, 1536),
    ("kv_a_proj 7168->576", 4096, 576, 7168),
    ("kv_b_proj 512->32768", 4096, 32768, 512),
    ("o_proj 16384->7168", 4096, 7168, 16384),
    ("mlp up 7168->18432", 4096, 18432, 7168),
    ("mlp down 18432->7168", 4096, 7168, 18432),
    ("square 8192^3", 8192, 8192, 8192),
]
WGRAD = [("wgrad mlp up", 4096, 18432, 7168), ("wgrad o_proj", 4096, 7168, 16384)]
GROUPED = [  # (name, groups, total tokens, N, K)
    ("experts up 8x 7168->2048", 8, 8192, 2048, 7168),
    ("experts down 8x 2048->7168", 8, 8192, 7168, 2048),
    ("experts up 32x 7168->2048", 32, 16384, 2048, 7168),
    ("experts down 32x 2048->7168", 32, 16384, 7168, 2048),
    # bench/fp8_train_step.py's MoE (32 experts top-4, 8,192 tokens a step): gate/up, and down (= their dgrad)
    ("moe-small up 32x 2048->1024", 32, 32768, 1024, 2048),
    ("moe-small down 32x 1024->2048", 32, 32768, 2048, 1024),
]
SMOKE_DENSE = [("smoke fwd", 256, 384, 320)]
SMOKE_WGRAD = [("smoke wgrad", 256, 192, 320)]
SMOKE_GROUPED = [("smoke grouped 4x", 4, 300, 256, 192)]


def timed(fn, device, iters: int) -> float:
    """Median seconds per call."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def uneven_offsets(groups: int, total: int, device, gen) -> torch.Tensor:
    w = torch.rand(groups, generator=gen) + 0.25
    counts = (w / w.sum() * total).long()
    counts[-1] += total - counts.sum()
    return torch.cumsum(counts, 0).to(torch.int32).to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--baseline-tree", default=None, help="a tree whose grouped_triton kernel runs as one more arm")
    ap.add_argument("--tiles", default="", help="Triton grouped-kernel tiles to add, BMxWARPSxSTAGES comma-separated")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    gen = torch.Generator().manual_seed(0)
    backends = []
    if device.type == "cuda":
        dg = import_deep_gemm()
        if dg is not None:
            backends.append(DeepGemmBackend(dg, strict=True))
        else:
            print("deep_gemm: not importable (put DeepGEMM in .dg/, see bench/README.md)", file=sys.stderr)
        backends.append(TorchScaledMMBackend())
        loop = TorchScaledMMBackend()
        loop.grouped_on_device, loop.name = False, "torch loop"
        backends.append(loop)
    else:
        backends.append(EmulatedBackend())
    ref = EmulatedBackend()
    base = None
    if args.baseline_tree and device.type == "cuda":  # the other tree's kernel, loaded under a name of its own
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "baseline_grouped_triton", os.path.join(args.baseline_tree, "rlcli/ops/fp8/grouped_triton.py"))
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    dense, wgrad, grouped = (SMOKE_DENSE, SMOKE_WGRAD, SMOKE_GROUPED) if args.smoke else (DENSE, WGRAD, GROUPED)
    iters = 3 if args.smoke else args.iters
    rows = []  # (kind, name, backend, tflops, bf16 tflops, err)

    def run(kind, name, flops, call, reference, bf16_call, extra=()):
        try:
            t_bf16 = timed(bf16_call, device, iters)
        except Exception as e:
            print(f"{kind} {name} bf16 baseline: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            t_bf16 = float("nan")
        for be in backends:
            if be.name == "torch loop" and not kind.startswith("grouped"):
                continue  # the same scaled_mm as "torch" outside grouped GEMMs
            try:
                out = call(be)
                err = rel_err(out, reference)
                t = timed(lambda: call(be), device, iters)
                rows.append((kind, name, be.name, flops / t / 1e12, flops / t_bf16 / 1e12, err))
            except Exception as e:  # one kernel's failure must not hide the others' numbers
                rows.append((kind, name, be.name, float("nan"), flops / t_bf16 / 1e12, float("nan")))
                print(f"{kind} {name} {be.name}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        for label, fn in extra:
            try:
                err = rel_err(fn(), reference)
                rows.append((kind, name, label, flops / timed(fn, device, iters) / 1e12, flops / t_bf16 / 1e12, err))
            except Exception as e:  # noqa: BLE001
                print(f"{kind} {name} {label}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        print(f"done {kind} {name}", file=sys.stderr, flush=True)

    for name, M, N, K in dense:
        x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
        w = (torch.randn(N, K, generator=gen) * 0.02).to(device, torch.bfloat16)
        (xq, xs), (wq, ws) = quantize_1x128(x), quantize_128x128(w)
        reference = ref.gemm(xq, xs, wq, ws, torch.float32)
        run("fwd", name, 2 * M * N * K, lambda be: be.gemm(xq, xs, wq, ws, torch.bfloat16), reference,
            lambda: torch.mm(x, w.t()))
    for name, M, N, K in wgrad:  # dW [N, K] = dy^T x, contraction over M tokens
        dy = torch.randn(M, N, generator=gen).to(device, torch.bfloat16)
        x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
        (aq, sa), (bq, sb) = quantize_1x128(dy.t()), quantize_1x128(x.t())
        reference = ref.gemm_1x128(aq, sa, bq, sb, torch.float32)
        run("wgrad", name, 2 * M * N * K, lambda be: be.gemm_1x128(aq, sa, bq, sb, torch.float32), reference,
            lambda: torch.mm(dy.t(), x))
        for be in backends:  # the two weight-gradient kernels the DeepGEMM backend chooses between, each alone
            if hasattr(be, "_wgrad_1d1d"):
                for kname, fn in (("dg 1d1d", lambda: be._wgrad_1d1d(aq, sa, bq, sb)),
                                  ("scaled_mm", lambda: be.torch.gemm_1x128(aq, sa, bq, sb, torch.float32))):
                    try:
                        err, t = rel_err(fn(), reference), timed(fn, device, iters)
                        rows.append(("wgrad", name, kname, 2 * M * N * K / t / 1e12, float("nan"), err))
                    except Exception as e:  # noqa: BLE001
                        print(f"wgrad {name} {kname}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
    for name, G, M, N, K in grouped:
        offs = uneven_offsets(G, M, device, gen)
        x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
        w = (torch.randn(G, N, K, generator=gen) * 0.02).to(device, torch.bfloat16)
        (xq, xs), (wq, ws) = quantize_1x128(x), quantize_128x128(w)
        reference = ref.grouped_gemm(xq, xs, wq, ws, offs, torch.float32)
        gmm = getattr(torch.nn.functional, "grouped_mm", None) if device.type == "cuda" else None
        if gmm is not None:
            bf16_call = lambda: gmm(x, w.transpose(-2, -1), offs=offs)  # noqa: E731
        else:
            ranges = list(zip([0] + offs.tolist()[:-1], offs.tolist()))
            bf16_call = lambda: [torch.mm(x[s:e], w[g].t()) for g, (s, e) in enumerate(ranges)]  # noqa: E731
        tiles = [t for t in args.tiles.split(",") if t] if device.type == "cuda" else []
        extra = [(f"triton {t}", lambda t=t: grouped_triton.grouped_gemm(
            xq, xs, wq, ws, offs, torch.bfloat16, tile=tuple(int(v) for v in t.split("x")))) for t in tiles]
        if base is not None:
            extra.append(("baseline tree", lambda: base.grouped_gemm(xq, xs, wq, ws, offs, torch.bfloat16)))
        run("grouped", name, 2 * M * N * K, lambda be: be.grouped_gemm(xq, xs, wq, ws, offs, torch.bfloat16),
            reference, bf16_call, extra)
        # from high-precision rows (the training path; DeepGEMM quantizes them into its padded layout; the
        # quantization of the same x is reused across calls, so the time is the GEMM's)
        run("groupedx", name, 2 * M * N * K, lambda be: be.grouped_gemm_x(x, False, wq, ws, offs, torch.bfloat16),
            reference, bf16_call)

    print(f"\nFP8 block-scaled GEMMs on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, "
          f"torch {torch.__version__}; TFLOP/s (median of {iters}); err = rel. Frobenius error vs dequantized "
          f"fp32 reference of the same FP8 operands")
    print(f"{'kind':8s} {'shape':30s} {'backend':14s} {'TFLOP/s':>9s} {'bf16':>9s} {'ratio':>7s} {'err':>9s}")
    for kind, name, be, tf, tb, err in rows:
        print(f"{kind:8s} {name:30s} {be:14s} {tf:9.3g} {tb:9.3g} {tf / tb:7.2f} {err:9.2e}")


if __name__ == "__main__":
    main()
