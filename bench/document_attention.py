"""Packed-row attention with document masks: every backend against the dense mask it replaced.

One packed row of T tokens holding documents of random lengths, GQA (32 query heads, 8
KV heads, head dim 128 by default), forward + backward, once per backend of
``rlcli.ops.document_attention.PackedCausalAttention`` (``sdpa`` per document, ``flex``,
``varlen``) and once with the old dense ``[T, T]`` boolean mask (skipped above
``--dense-max`` tokens: it is what does not scale). Prints per path ms per step, peak
memory, the ratio to the dense mask, and the largest difference of output and gradients
against the per-document SDPA path; then the same check for a context-parallel rank's
query subset (chunks r and 2cp-1-r of the row, cp=2) with the full row's keys.

    python bench/document_attention.py                 # CUDA, bf16, T = 16384 and 65536
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
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


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
    backends = ["sdpa", "flex", "varlen"] if device.type == "cuda" else ["sdpa"]
    results = {}
    for name in backends:
        try:
            attn = PackedCausalAttention(pos.cpu(), backend=name, device=device)
            results[name] = run(lambda q, k, v: attn(0, q, k, v, scale), q, k, v, dy, args.iters, device)
        except Exception as e:  # a backend missing on this torch build is reported, not fatal
            print(f"  {name}: unavailable ({type(e).__name__}: {str(e)[:120]})")
    if T <= args.dense_max:
        try:
            results["dense mask"] = run(lambda q, k, v: dense(q, k, v, pos, scale), q, k, v, dy, args.iters, device)
        except torch.OutOfMemoryError:
            print(f"  dense mask: out of memory at T = {T}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ref = results["sdpa"]
    print(f"T = {T} tokens, {len(lengths)} documents, {Hq}/{Hkv} heads x {D}, {dtype}")
    print(f"  {'path':<11} {'ms/step':>9} {'peak GiB':>9} {'vs dense':>9} {'out diff':>9} {'grad diff':>9}")
    for name, (dt, peak, out, grads) in results.items():
        ratio = results["dense mask"][0] / dt if "dense mask" in results else float("nan")
        gd = max(rel(a, b) for a, b in zip(grads, ref[3]))
        print(f"  {name:<11} {dt * 1e3:>9.2f} {peak:>9.2f} {ratio:>8.2f}x {rel(out, ref[2]):>9.1e} {gd:>9.1e}")
    # A CP rank's queries (cp = 2, rank 0: chunks 0 and 3) against the whole row's keys.
    C = T // 4
    qi = torch.cat([torch.arange(0, C), torch.arange(3 * C, 4 * C)])
    with torch.no_grad():
        full = PackedCausalAttention(pos.cpu(), backend="sdpa")(0, q, k, v, scale)[:, qi.to(device)].float()
        for name in backends:
            if name == "varlen":
                continue
            try:
                attn = PackedCausalAttention(pos.cpu(), backend=name, query_index_T=qi, device=device)
                out = attn(0, q[:, qi.to(device)], k, v, scale).float()
                print(f"  cp query subset, {name}: out diff {rel(out, full):.1e}")
            except Exception as e:
                print(f"  cp query subset, {name}: unavailable ({type(e).__name__}: {str(e)[:120]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dense-max", type=int, default=16384, help="longest row the dense-mask baseline runs")
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
