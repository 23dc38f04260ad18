"""MoE experts: one grouped GEMM per projection against the Python loop over experts.

Runs one Qwen3-MoE-like MoE layer (default: Qwen3-30B-A3B's shape: hidden 2048, 128
experts of width 768, top-8) forward + backward on a batch of tokens, twice, side by
side: rlcli's path (tokens sorted by expert, ``grouped_mm`` per projection, counts on the
device) and the baseline it replaced (``counts.tolist()`` then one matmul per expert and
projection). Routing is the layer's own router (chosen once, then fixed for every path), so the
per-expert counts are uneven the way real ones are. Prints per path the time per step,
tokens/s, peak memory and the ratio, and per path the error of the output and of the
worst parameter gradient against the same loop computed in fp32.

Torch only (plus rlcli.models.moe from this checkout), so it runs where msgspec/zmq are
not installed:

    python bench/moe_grouped_gemm.py                 # CUDA, bf16, Qwen3-30B-A3B layer, 16k tokens
    python bench/moe_grouped_gemm.py --smoke         # CPU, fp32, a tiny layer (checks it runs)

``use_loop_experts(model)`` switches a whole model's experts to the baseline (for
model-level throughput benchmarks).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlcli.models.config import ModelArgs  # noqa: E402
from rlcli.models.moe import MoE, GroupedExperts  # noqa: E402
from rlcli.ops import grouped_gemm  # noqa: E402


class LoopExperts(GroupedExperts):
    """The baseline: one host sync for the counts, then a matmul per expert and projection."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, n in enumerate(num_tokens_per_expert_E.tolist()):
            if n:
                xe = x_RD[start:start + n]
                h = F.silu(xe @ self.w_gate[e].T) * (xe @ self.w_up[e].T)
                outs.append(h @ self.w_down[e].T)
            start += n
        return torch.cat(outs) if outs else x_RD.new_zeros(0, x_RD.shape[1])


def use_loop_experts(model: torch.nn.Module) -> int:
    """Switch every GroupedExperts of ``model`` to the loop baseline (in place); returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is GroupedExperts:
            m.__class__ = LoopExperts
            n += 1
    return n


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, with NaN counted as infinitely far."""
    return ((a - b).abs().nan_to_num(nan=float("inf")).max() / b.abs().max().clamp(min=1e-30)).item()


def make_layer(args: ModelArgs, device, dtype, seed: int = 0) -> MoE:
    layer = MoE(args, 0)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return layer.to(device=device, dtype=dtype)


def step(layer: MoE, x: torch.Tensor, dy: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Forward + backward with the experts chosen once (``idx``), so every path sends the same
    tokens to the same experts and differences come from the GEMMs alone."""
    scores = layer.gate.scores(x)
    y = layer.routed(x, idx, layer.gate.gates(scores, idx, x.dtype))
    y.backward(dy)
    return y


def time_path(layer, x, dy, idx, iters: int, warmup: int, device) -> tuple[float, float, torch.Tensor]:
    for _ in range(warmup):
        step(layer, x, dy, idx)
    layer.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        y = step(layer, x, dy, idx)
    sync()
    dt = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return dt, peak, y.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny layer on CPU in fp32")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--expert-width", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.experts, args.expert_width, args.top_k, args.iters = 512, 64, 16, 32, 4, 3
    if args.smoke:
        torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    margs = ModelArgs(model_type="qwen3_moe", vocab_size=1, hidden_size=args.hidden, intermediate_size=1,
                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=1,
                      num_experts=args.experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.expert_width, norm_topk_prob=True, moe_layers=[0])
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
    dy = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)

    with torch.no_grad():
        idx = make_layer(margs, device, dtype).gate.select(make_layer(margs, device, dtype).gate.scores(x))

    def outputs(layer, x, dy):
        layer.zero_grad(set_to_none=True)
        y = step(layer, x, dy, idx).detach().float()
        return y, {n: p.grad.detach().float() for n, p in layer.named_parameters()}

    # The truth: the loop in fp32 on the same device, same routing.
    ref_layer = make_layer(margs, device, torch.float32)
    use_loop_experts(ref_layer)
    ref_y, ref_grads = outputs(ref_layer, x.float(), dy.float())
    del ref_layer

    results, errors = {}, {}
    for name in ("grouped", "loop"):
        layer = make_layer(margs, device, dtype)
        if name == "loop":
            use_loop_experts(layer)
        dt, peak, _ = time_path(layer, x, dy, idx, args.iters, warmup=2 if not args.smoke else 1, device=device)
        y, grads = outputs(layer, x, dy)
        worst = max(grads, key=lambda n: relative(grads[n], ref_grads[n]))
        finite = all(bool(torch.isfinite(g).all()) for g in grads.values()) and bool(torch.isfinite(y).all())
        results[name] = (dt, peak)
        errors[name] = (relative(y, ref_y), relative(grads[worst], ref_grads[worst]), worst, finite)
        del layer
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {dtype}, torch {torch.__version__}; "
          f"{args.tokens} tokens, hidden {args.hidden}, {args.experts} experts x {args.expert_width}, top-{args.top_k}")
    kernel = "grouped_mm kernel" if grouped_gemm._works.get((device.type, dtype)) else "loop fallback (no kernel here)"
    print(f"grouped path ran the {kernel}; routing fixed once, errors relative to the loop in fp32:")
    for name, (out_err, grad_err, worst, finite) in errors.items():
        print(f"  {name:<8} output {out_err:.2e}, worst gradient {grad_err:.2e} ({worst}), all finite: {finite}")
    print(f"{'path':<8} {'ms/step':>9} {'tokens/s':>12} {'peak GiB':>9}")
    for name, (dt, peak) in results.items():
        print(f"{name:<8} {dt * 1e3:>9.2f} {args.tokens / dt:>12.0f} {peak:>9.2f}")
    print(f"grouped / loop speed-up: {results['loop'][0] / results['grouped'][0]:.2f}x")


if __name__ == "__main__":
    main()
