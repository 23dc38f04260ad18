"""An FP8 engine's decode linears: the fused Triton kernel against quantize-then-``scaled_mm``, and bf16.

    python bench/fp8_decode_linear.py            # on an H100/H200
    python bench/fp8_decode_linear.py --sweep    # also every tile width (BN 16..128)

Each arm runs one linear of a few rows (a decode batch) from a bf16 activation, as rl-infer's FP8
engine does (FP8 weights, 128x128 block scales), on the layer shapes of Qwen3-0.6B and
DeepSeek-V3 (hidden 7168):

  fused     rlcli.ops.fp8.linear_triton.linear: the 1x128 quantization inside the GEMM, one kernel
            (what ``make_backend(inference=True)`` runs where ``linear_triton.serves``)
  baseline  the torch backend's quantize-then-GEMM (``gemm_x`` of a backend made for training):
            the Triton quantization, the rows and scales padded to cuBLASLt's 128, ``scaled_mm``
  bf16      ``F.linear`` on the bf16 weight
  q+f       the activation quantized by its own kernel (``kernels.quantize_act``), then the fused
            kernel reading the FP8 rows (``linear(..., xs=...)``): no quantization redone per tile
  q+f1      the same unsplit along K (past 64 rows the row tiles alone may fill the GPU)
  q+g       the activation quantized, then the grouped kernel (rlcli.ops.fp8.grouped_triton) with one group

Each arm is captured in a CUDA graph of ``--calls`` back-to-back calls and the graph replayed, as
the engine's decode graphs run them, so the figure is device time with no launch overhead (the
gaps between a graph's kernels included). Printed: microseconds per call and the ratios
baseline/fused and bf16/fused (above 1: fused is faster). The fused output is checked against the
baseline's (relative Frobenius error; bf16 rounding alone gives ~2e-3).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import graph_us  # noqa: E402

from rlcli.ops.fp8 import grouped_triton, linear_triton  # noqa: E402
from rlcli.ops.fp8.backends import TorchScaledMMBackend  # noqa: E402
from rlcli.ops.fp8.kernels import quantize_act  # noqa: E402
from rlcli.ops.fp8.quant import quantize_128x128  # noqa: E402

SHAPES = [  # (name, N, K)
    ("qwen3-0.6b q_proj 1024->2048", 2048, 1024),
    ("qwen3-0.6b k/v_proj 1024->1024", 1024, 1024),
    ("qwen3-0.6b o_proj 2048->1024", 1024, 2048),
    ("qwen3-0.6b gate/up 1024->3072", 3072, 1024),
    ("qwen3-0.6b down 3072->1024", 1024, 3072),
    ("dsv3 q_a_proj 7168->1536", 1536, 7168),
    ("dsv3 q_b_proj 1536->24576", 24576, 1536),
    ("dsv3 kv_a_proj 7168->576", 576, 7168),
    ("dsv3 o_proj 16384->7168", 7168, 16384),
    ("dsv3 shared up 7168->4096", 4096, 7168),
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64", help="comma-separated decode batch sizes")
    ap.add_argument("--calls", type=int, default=50, help="calls per captured graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time every tile width BN (K unsplit) and K split "
                    "(default BN)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not linear_triton.available():
        raise SystemExit("fp8_decode_linear: needs a CUDA GPU (Hopper) and Triton")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    baseline = TorchScaledMMBackend()  # made for training: no fused rows
    rows = [int(r) for r in args.rows.split(",")]
    widths = (16, 32, 64, 128) if args.sweep else ()
    splits = (1, 2, 4, 8, 16) if args.sweep else ()
    print(f"{torch.cuda.get_device_name()}; us per call, {args.calls} calls a graph; ratios: x/fused; "
          "sk: the K splits the fused arm chose")
    head = (f"{'shape':34s} {'M':>3s} {'bf16':>7s} {'base':>7s} {'fused':>7s} {'sk':>3s} {'base/f':>7s} {'bf16/f':>7s} "
            f"{'err':>8s} {'q+f':>7s} {'q+f1':>7s} {'q+g':>7s}")
    print(head + "".join(f" {'BN' + str(w):>7s}" for w in widths) + "".join(f" {'SK' + str(k):>7s}" for k in splits))
    totals = {m: [0.0, 0.0, 0.0] for m in rows}
    for name, N, K in SHAPES:
        w = (torch.randn(N, K, generator=gen) * 0.02).to(dev, torch.bfloat16)
        wq, ws = quantize_128x128(w)
        for m in rows:
            x = torch.randn(m, K, generator=gen).to(dev, torch.bfloat16)
            ref = baseline.gemm_x(x, False, wq, ws, torch.bfloat16)
            err = rel_err(linear_triton.linear(x, wq, ws, False, torch.bfloat16), ref)
            t_bf16 = graph_us(lambda: F.linear(x, w), args.calls, args.replays)
            t_base = graph_us(lambda: baseline.gemm_x(x, False, wq, ws, torch.bfloat16), args.calls, args.replays)
            t_fused = graph_us(lambda: linear_triton.linear(x, wq, ws, False, torch.bfloat16), args.calls,
                               args.replays)
            sweep = [graph_us(lambda bn=bn: linear_triton.linear(x, wq, ws, False, torch.bfloat16, bn=bn, splits=1),
                              args.calls, args.replays) for bn in widths]
            sweep += [graph_us(lambda k=k: linear_triton.linear(x, wq, ws, False, torch.bfloat16, splits=k),
                               args.calls, args.replays) for k in splits]
            sk = linear_triton.split_k(N, K, linear_triton.block_n(N), linear_triton._sms(dev))

            def prequantized():
                xq, xs = quantize_act(x, False)
                return linear_triton.linear(xq, wq, ws, False, torch.bfloat16, xs=xs)

            def prequantized_unsplit():
                xq, xs = quantize_act(x, False)
                return linear_triton.linear(xq, wq, ws, False, torch.bfloat16, xs=xs, splits=1)

            one = torch.tensor([m], dtype=torch.int32, device=dev)

            def grouped():
                xq, xs = quantize_act(x, False)
                return grouped_triton.grouped_gemm(xq, xs, wq[None], ws[None], one, torch.bfloat16)

            t_preq = graph_us(prequantized, args.calls, args.replays)
            t_preq1 = graph_us(prequantized_unsplit, args.calls, args.replays)
            t_grp = graph_us(grouped, args.calls, args.replays)
            for i, t in enumerate((t_bf16, t_base, t_fused)):
                totals[m][i] += t
            print(f"{name:34s} {m:3d} {t_bf16:7.2f} {t_base:7.2f} {t_fused:7.2f} {sk:3d} {t_base / t_fused:6.2f}x "
                  f"{t_bf16 / t_fused:6.2f}x {err:8.1e} {t_preq:7.2f} {t_preq1:7.2f} {t_grp:7.2f}" + "".join(f" {t:7.2f}" for t in sweep),
                  flush=True)
    for m, (b16, base, fused) in totals.items():
        print(f"all shapes, M={m}: bf16 {b16:.1f} us, baseline {base:.1f} us, fused {fused:.1f} us: "
              f"baseline/fused {base / fused:.2f}x, bf16/fused {b16 / fused:.2f}x")


if __name__ == "__main__":
    main()
