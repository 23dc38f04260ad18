"""Packed-row attention with document masks: every backend against the dense mask it replaced.

One packed row of T tokens holding documents of random lengths, GQA (32 query heads, 8
KV heads, head dim 128 by default), forward + backward, once per backend of
``rlcli.ops.document_attention.PackedCausalAttention`` (``sdpa`` per document, ``flex``,
``varlen``) and once with the old dense ``[T, T]`` boolean mask (skipped above
``--dense-max`` tokens: it is what does not scale). Prints, line by line as each path is
measured (cheapest first, FlexAttention last because it compiles), ms per step, peak
memory and the largest difference of output and gradients against the per-document SDPA
path; then the same check for a context-parallel rank's query subset (chunks r and
2cp-1-r of the row, cp=2) with the full row's keys. A path that fails prints why.

    python bench/document_attention.py                 # CUDA, bf16, T = 8192 and 32768
    python bench/document_attention.py --smoke         # CPU, fp32, small (flex forward only)
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlcli.ops.document_attention import PackedCausalAttention, doc_ids_from_positions  # noqa: E402


def dense(q, k, v, pos, scale):
    doc = doc_ids_from_positions(pos)
    T = pos.shape[1]
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=pos.device).tril()
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def run(fn, q, k, v, dy, iters, device):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(dy)  # warm-up (compiles flex)
    grads = [t.grad.clone() for t in (q, k, v)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(dy)
    sync()
    dt = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return dt, peak, out.detach().float(), [g.float() for g in grads]


def rel(a, b):
    """max |a - b| / max |b|, NaN counted as infinitely far."""
    return ((a - b).abs().nan_to_num(nan=float("inf")).max() / b.abs().max().clamp(min=1e-30)).item()


def bench_length(T, args, device, dtype):
    g = torch.Generator().manual_seed(T)
    lengths, left = [], T
    while left:
        n = min(left, int(torch.randint(T // 16, T // 4 + 1, (1,), generator=g)))
        lengths.append(n)
        left -= n
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    Hq, Hkv, D = args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, T, Hq, D, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(1, T, Hkv, D, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(1, T, Hkv, D, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(1, T, Hq, D, generator=g).to(device, dtype)
    scale = D ** -0.5
    print(f"T = {T} tokens, {len(lengths)} documents, {Hq}/{Hkv} heads x {D}, {dtype}", flush=True)
    print(f"  {'path':<11} {'ms/step':>9} {'peak GiB':>9} {'out diff':>9} {'grad diff':>9}  (diffs vs sdpa)", flush=True)
    # Cheapest first, each line printed as soon as it is measured; FlexAttention (compiles) last.
    paths = [("sdpa", None)]
    if device.type == "cuda":
        paths.append(("varlen", None))
    if T <= args.dense_max:
        paths.append(("dense mask", lambda q, k, v: dense(q, k, v, pos, scale)))
    if device.type == "cuda":
        paths.append(("flex", None))
    ref = None
    for name, fn in paths:
        try:
            if fn is None:
                attn = PackedCausalAttention(pos.cpu(), backend=name, device=device)
                fn = lambda q, k, v, attn=attn: attn(0, q, k, v, scale)  # noqa: E731
            dt, peak, out, grads = run(fn, q, k, v, dy, args.iters, device)
        except Exception as e:  # a backend missing on this torch build (or an OOM) is reported, not fatal
            print(f"  {name:<11} unavailable ({type(e).__name__}: {str(e)[:150]})", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if ref is None:
            ref = (out, grads)
        gd = max(rel(a, b) for a, b in zip(grads, ref[1]))
        print(f"  {name:<11} {dt * 1e3:>9.2f} {peak:>9.2f} {rel(out, ref[0]):>9.1e} {gd:>9.1e}", flush=True)
    # A CP rank's queries (cp = 2, rank 0: chunks 0 and 3) against the whole row's keys.
    C = T // 4
    qi = torch.cat([torch.arange(0, C), torch.arange(3 * C, 4 * C)])
    with torch.no_grad():
        full = PackedCausalAttention(pos.cpu(), backend="sdpa")(0, q, k, v, scale)[:, qi.to(device)].float()
        for name in ["sdpa", "flex"] if device.type == "cuda" else ["sdpa"]:
            try:
                attn = PackedCausalAttention(pos.cpu(), backend=name, query_index_T=qi, device=device)
                out = attn(0, q[:, qi.to(device)], k, v, scale).float()
                print(f"  cp query subset, {name}: out diff {rel(out, full):.1e}", flush=True)
            except Exception as e:
                print(f"  cp query subset, {name}: unavailable ({type(e).__name__}: {str(e)[:120]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dense-max", type=int, default=8192, help="longest row the dense-mask baseline runs")
    args = ap.parse_args()
    if args.smoke:
        torch.set_num_threads(1)
        args.lengths, args.heads, args.kv_heads, args.head_dim, args.iters = [256], 4, 2, 16, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    for T in args.lengths:
        bench_length(T, args, device, dtype)


if __name__ == "__main__":
    main()
