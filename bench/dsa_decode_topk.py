"""DSA's decode choice in a CUDA graph: ``dsa_triton.topk_rows`` against the torch rule it replaced.

    python bench/dsa_decode_topk.py     # on an H100/H200

A decode graph's indexer scores span ``max_model_len`` whatever the contexts' lengths (positions
past a context score -inf). Both arms choose ``index_topk`` = 2048 positions per row by the same
rule (the k largest, exact ties at the cut to the earlier position):

  topk_rows  one Triton program per row, reading the row's first ``lens[t]`` scores only (radix
             select, then one listing pass)
  baseline   the rule in torch over the whole width, as ``paged_select_topk`` ran it before: a float
             top-k for the k-th value, the comparisons and a running count of ties, the kept
             positions scattered to their ranks (no host sync)

for widths (``max_model_len``) 8k to 128k, contexts of 1k to the width, 16 and 64 rows. Each arm
is captured in a CUDA graph of ``--calls`` calls and the graph replayed; printed: microseconds per
call (one layer's choice) and baseline/topk_rows. The two arms' positions are checked equal.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import graph_us  # noqa: E402

from rlcli.ops import dsa_triton  # noqa: E402


def baseline_choice(scores_TW: torch.Tensor, k: int) -> torch.Tensor:
    """The torch rule over the whole width, positions scattered to their ranks (5dae25d's decode path)."""
    kth_T1 = scores_TW.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores_TW > kth_T1
    tied = scores_TW == kth_T1
    need_T1 = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    take = above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= need_T1))
    T, W = take.shape
    rank = torch.where(take, take.cumsum(-1) - 1, k)
    out = torch.empty(T, k + 1, dtype=torch.long, device=take.device)
    out.scatter_(1, rank, torch.arange(W, device=take.device).expand(T, W))
    return out[:, :k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--widths", default="8192,32768,131072")
    ap.add_argument("--contexts", default="1000,3000,30000,131072", help="context lengths (those <= the width run)")
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dsa_decode_topk: needs a CUDA GPU")
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; k = {args.topk}; us per call")
    print(f"{'width':>7s} {'context':>7s} {'rows':>4s} {'baseline':>9s} {'topk_rows':>9s} {'ratio':>7s}")
    for W in (int(w) for w in args.widths.split(",")):
        for n in (int(c) for c in args.contexts.split(",")):
            if n > W:
                continue
            for T in (int(r) for r in args.rows.split(",")):
                g = torch.Generator(device=dev).manual_seed(W + n + T)
                # indexer scores are ReLU sums weighted by per-head weights: many exact zeros, ties
                scores = torch.randn(T, W, device=dev, generator=g).relu_().round_(decimals=2)
                lens = torch.full((T,), n, dtype=torch.int32, device=dev)
                scores[:, n:] = float("-inf")
                want, got = baseline_choice(scores, args.topk), dsa_triton.topk_rows(scores, lens, args.topk)
                ok = torch.equal(got[:, :min(n, args.topk)], want[:, :min(n, args.topk)])
                t_base = graph_us(lambda: baseline_choice(scores, args.topk), args.calls, args.replays)
                t_new = graph_us(lambda: dsa_triton.topk_rows(scores, lens, args.topk), args.calls, args.replays)
                print(f"{W:7d} {n:7d} {T:4d} {t_base:9.1f} {t_new:9.1f} {t_base / t_new:6.2f}x"
                      f"{'' if ok else '  MISMATCH'}", flush=True)


if __name__ == "__main__":
    main()
