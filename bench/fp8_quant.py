"""FP8 quantization kernels: Triton (one pass) against the torch reference, GB/s against a copy.

    python bench/fp8_quant.py            # H200, a few seconds
    python bench/fp8_quant.py --smoke    # CPU: torch reference only; with TRITON_INTERPRET=1 also Triton
    python bench/fp8_quant.py --sweep    # H200: every launch configuration of each kernel (kernels.LAUNCH)

For each operation and shape it checks the Triton output against ``rlcli.ops.fp8.quant`` on the
same device bit for bit (data and scales; ``exact`` column), then times both (CUDA events,
median of ``--iters``). GB/s counts the bytes the operation must move: the bf16 input read once
plus the FP8 data and fp32 scales written. ``copy`` is a bf16 ``clone`` of the input: the
bandwidth a one-pass kernel can reach on this machine. Operations:
  rows      1x128 tiles along K                     (forward x, dgrad dy)
  cols      1x128 tiles of x^T along the tokens     (wgrad operands), written transposed
  both      rows + cols from one read               (what a training linear runs)
  weight    128x128 blocks + the transposed copy    (once per optimizer step)
Needs torch + triton (on the GPU); imports rlcli.ops.fp8 only.
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlcli.ops.fp8 import kernels, quant  # noqa: E402

SHAPES = [(8192, 2048), (8192, 8192), (16384, 7168)]
WEIGHTS = [(2048, 8192), (8192, 2048), (7168, 18432)]
SMOKE_SHAPES, SMOKE_WEIGHTS = [(256, 384)], [(256, 384)]


def timed(fn, device, iters: int) -> float:
    fn()
    if device.type != "cuda":
        import time
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def flat(outs) -> list[torch.Tensor]:
    if isinstance(outs, torch.Tensor):
        return [outs]
    return [t for o in outs for t in flat(o)]


def exact(a, b) -> bool:
    fa, fb = flat(a), flat(b)
    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return len(fa) == len(fb) and all(x.shape == y.shape and torch.equal(bits(x), bits(y)) for x, y in zip(fa, fb))


def act_cases(x: torch.Tensor) -> dict:
    """``op -> (Triton call, reference call, bytes that must move)`` of the activation quantizations of ``x``:
    the bf16 input read once, the FP8 data and fp32 scales written."""
    M, K = x.shape
    kb, mb = -(-K // 128), -(-M // 128)
    rd, fp8 = 2 * M * K, M * K
    return {"rows": (lambda: kernels.quantize_act(x), lambda: quant.quantize_1x128(x), rd + fp8 + 4 * M * kb),
            "cols": (lambda: kernels.quantize_act(x, rows=False, cols=True), lambda: quant.quantize_1x128(x.t()),
                     rd + fp8 + 4 * K * mb),
            "both": (lambda: kernels.quantize_act(x, rows=True, cols=True),
                     lambda: (quant.quantize_1x128(x), quant.quantize_1x128(x.t())),
                     rd + 2 * fp8 + 4 * (M * kb + K * mb))}


def weight_case(w: torch.Tensor) -> tuple:
    """The same for the 128x128 weight quantization and its transposed copy."""
    def ref():
        q, s = quant.quantize_128x128(w)
        return (q, s), quant.transpose_blocks(q, s)
    N, K = w.shape
    return lambda: kernels.quantize_weight(w, transposed=True), ref, 4 * N * K


SWEEP = {"rows": [(bm, w) for bm in (16, 32, 64, 128, 256) for w in (1, 2, 4, 8)],
         "cols": [(128, w) for w in (2, 4, 8, 16)], "both": [(128, w) for w in (2, 4, 8, 16)],
         "weight": [(128, w) for w in (2, 4, 8, 16)]}


def sweep(device, iters: int) -> None:
    """Each kernel under each launch configuration of ``SWEEP``, checked bit for bit against the
    reference, timed; the default (``kernels.LAUNCH``) marked, the fastest named per op and shape."""
    gen = torch.Generator().manual_seed(0)
    default = dict(kernels.LAUNCH)
    best: dict[str, list] = {}
    print(f"{'op':7s} {'shape':>14s} {'BM':>4s} {'warps':>5s} {'us':>9s} {'GB/s':>7s} {'exact':>6s}")
    for M, K in SHAPES:
        x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
        for op, (tri, ref, nbytes) in {**act_cases(x), "weight": weight_case(x)}.items():
            want = ref()
            for cfg in SWEEP[op]:
                kernels.LAUNCH[op] = cfg
                try:
                    ok = exact(tri(), want)
                    t = timed(tri, device, iters)
                except Exception as e:  # noqa: BLE001 -- a configuration Triton cannot build: next one
                    print(f"{op:7s} {str((M, K)):>14s} {cfg[0]:4d} {cfg[1]:5d} failed: {type(e).__name__}")
                    continue
                mark = " <- default" if cfg == default[op] else ""
                print(f"{op:7s} {str((M, K)):>14s} {cfg[0]:4d} {cfg[1]:5d} {t * 1e6:9.1f} {nbytes / t / 1e9:7.0f} "
                      f"{str(ok):>6s}{mark}", flush=True)
                best.setdefault(op, []).append(((M, K), cfg, t, ok))
            kernels.LAUNCH[op] = default[op]
    print("\nFastest exact configuration per op (sum of its times over the shapes, against the default's)")
    for op, rows in best.items():
        total: dict[tuple, float] = {}
        for _, cfg, t, ok in rows:
            total[cfg] = total.get(cfg, 0.0) + (t if ok else float("inf"))
        fastest = min(total, key=total.get)
        print(f"  {op:7s} BM {fastest[0]:4d} warps {fastest[1]:3d}: {total[fastest] * 1e6:9.1f} us; default "
              f"{default[op]}: {total.get(default[op], float('nan')) * 1e6:9.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time every launch configuration (GPU)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if args.sweep:
        device = torch.device("cuda")
        return sweep(device, args.iters)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    triton_ok = kernels.available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    if device.type == "cuda" and not triton_ok:
        print("triton does not import: torch reference only", file=sys.stderr)
    iters = 2 if args.smoke else args.iters
    gen = torch.Generator().manual_seed(0)
    rows = []  # (op, shape, bytes, t_triton, t_torch, t_copy, exact)

    def run(op, shape, x, nbytes, tri, ref):
        t_copy = timed(lambda: x.clone(), device, iters)
        t_ref = timed(ref, device, iters)
        if triton_ok:
            try:
                ok = exact(tri(), ref())
                t_tri = timed(tri, device, iters)
            except Exception as e:  # noqa: BLE001 -- report, keep measuring the others
                print(f"{op} {shape}: Triton failed: {type(e).__name__}: {str(e)[:2000]}", file=sys.stderr)
                ok, t_tri = False, float("nan")
        else:
            ok, t_tri = None, float("nan")
        rows.append((op, shape, nbytes, t_tri, t_ref, t_copy, ok))

    for M, K in SMOKE_SHAPES if args.smoke else SHAPES:
        x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
        for op, (tri, ref, nbytes) in act_cases(x).items():
            run(op, (M, K), x, nbytes, tri, ref)
    for N, K in SMOKE_WEIGHTS if args.smoke else WEIGHTS:
        w = (torch.randn(N, K, generator=gen) * 0.02).to(device, torch.bfloat16)
        tri, ref, nbytes = weight_case(w)
        run("weight", (N, K), w, nbytes, tri, ref)

    special = None
    if triton_ok:  # every e4m3 value, every rounding midpoint and its neighbours, subnormals, signed zeros
        xs = quant.rounding_cases().to(device)  # scale 1: q == x rounded
        special = all(exact(kernels.quantize_act(xs, u, rows=True, cols=True),
                            (quant.quantize_1x128(xs, u), quant.quantize_1x128(xs.t(), u))) for u in (False, True))

    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\nFP8 quantization, {where}, torch {torch.__version__}; median of {iters}; GB/s = bytes that must "
          f"move / time; copy = bf16 clone of the input")
    print(f"{'op':7s} {'shape':>14s} {'triton us':>10s} {'torch us':>9s} {'x torch':>8s} {'triton GB/s':>12s} "
          f"{'copy GB/s':>10s} {'of copy':>8s} {'exact':>6s}")
    for op, shape, nbytes, tt, tr, tc, ok in rows:
        copy_bw = 2 * 2 * shape[0] * shape[1] / tc / 1e9
        bw = nbytes / tt / 1e9
        print(f"{op:7s} {str(shape):>14s} {tt * 1e6:10.1f} {tr * 1e6:9.1f} {tr / tt:8.2f} {bw:12.0f} {copy_bw:10.0f} "
              f"{bw / copy_bw:8.2f} {str(ok):>6s}")
    if special is not None:
        print(f"every e4m3 value, rounding midpoint and neighbour, subnormal (fp32 and UE8M0 scales): exact {special}")


if __name__ == "__main__":
    main()
