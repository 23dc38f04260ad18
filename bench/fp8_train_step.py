"""A full training step (forward + backward + AdamW) in FP8 against bf16, same model, same data.

    python bench/fp8_train_step.py --noise         # H200: ~1B dense Llama and a small Qwen3-MoE, 50 steps each
    python bench/fp8_train_step.py --smoke         # CPU: tiny models, emulated FP8, 4 steps

Each model is built twice from the same seed (bf16 parameters on GPU, fp32 on CPU; AdamW), once left as is and
once passed through ``convert_to_fp8`` (every Linear except lm_head, plus the stacked
experts; router and embeddings stay bf16). The bf16 MoE baseline is the model's own grouped
experts (one bf16 grouped GEMM per projection). Both train on the same sequence of batches
(a fixed pool of token sequences made of repeated random motifs, so the loss falls within
50 steps). It prints the median step time of each (after warm-up: DeepGEMM JIT-compiles
every new shape, 5-9 s each, in the first steps), the speed-up, and both loss curves
(every 5th step side by side, and the largest |loss_fp8 - loss_bf16| over all steps, read
against two bf16 runs from different init seeds with ``--noise``). On the GPU it then
profiles one step of each and prints GPU time per kernel class (FP8 GEMMs, bf16 GEMMs,
quantization, attention, elementwise/other) and the top FP8-step kernels. Quantizers: the
Triton kernels on CUDA (``--quant auto``), or the torch reference (``--quant torch``).
Needs torch + safetensors (rlcli.models, rlcli.ops.fp8); no msgspec/zmq.
"""

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if os.path.isdir(os.path.join(ROOT, ".dg")):
    sys.path.insert(0, os.path.join(ROOT, ".dg"))

from rlcli.models import ModelArgs, build_model  # noqa: E402
from rlcli.ops.fp8.convert import convert_to_fp8  # noqa: E402
from rlcli.ops.fp8 import runtime  # noqa: E402

DENSE_1B = {"model_type": "llama", "vocab_size": 32768, "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
MOE_SMALL = {"model_type": "qwen3_moe", "vocab_size": 32768, "hidden_size": 2048, "intermediate_size": 6144,
             "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
             "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 1024, "norm_topk_prob": True,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
SMOKE_DENSE = {**DENSE_1B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
SMOKE_MOE = {**MOE_SMALL, "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 128}


def batches(vocab: int, batch: int, seq: int, pool: int, seed: int) -> list[torch.Tensor]:
    """``pool`` batches of sequences that repeat a random 16-token motif (learnable by copying)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(pool):
        motif = torch.randint(0, vocab, (batch, 16), generator=gen)
        out.append(motif.repeat(1, seq // 16 + 1)[:, :seq].contiguous())
    return out


def classify(name: str) -> str:
    """Kernel class of a CUDA kernel name (aten op names on the CPU)."""
    import re

    def has(pattern: str) -> bool:
        return re.search(pattern, name, re.IGNORECASE) is not None

    if has(r"_quant_kernel"):
        return "quant"
    if has(r"flash|fmha|attention|sdpa"):
        return "attention"
    if has(r"deep_gemm|gemm|cutlass|xmma|nvjet|^aten::(mm|addmm|bmm|_grouped_mm)$"):
        return "fp8 gemm" if has(r"deep_gemm|fp8|f8|e4m3|float8|blockwise|scaled_mm") else "bf16 gemm"
    if has(r"amax|float8|e4m3|fp8"):
        return "quant"
    if has(r"multi_tensor|adam|foreach|lerp|addcdiv"):
        return "optimizer"
    return "elementwise/other"


def profile_step(model, opt, ids) -> dict:
    """GPU ms per kernel class of one full step (forward, backward, optimizer), and the top kernels."""
    from torch.profiler import ProfilerActivity, profile as prof

    cuda = ids.is_cuda
    with prof(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
    classes, kernels = {}, {}
    for ev in p.events():  # CPU (--smoke): self time of aten ops stands in for kernels
        if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and not ev.name.startswith("aten::"):
            continue
        ms = (ev.time_range.elapsed_us() if cuda else ev.self_cpu_time_total) / 1e3
        classes[classify(ev.name)] = classes.get(classify(ev.name), 0.0) + ms
        kernels[ev.name] = kernels.get(ev.name, 0.0) + ms
    return {"classes": classes, "top": sorted(kernels.items(), key=lambda kv: -kv[1])[:12]}


def train(hf: dict, fp8: bool, backend: str, data: list[torch.Tensor], steps: int, device, lr: float,
          seed: int = 0, profile: bool = False):
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU bf16 matmuls are slow
    model = build_model(ModelArgs.from_hf(hf), device=device, dtype=dtype)
    model.init_weights(seed=seed)
    if fp8:
        cfg = SimpleNamespace(backend=backend, include=["*"], exclude=["*embed_tokens", "lm_head", "*.mlp.gate"],
                              ue8m0=False)
        convert_to_fp8(model, cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses, times = [], []
    for step in range(steps):
        ids = data[step % len(data)].to(device)
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    breakdown = profile_step(model, opt, data[0].to(device)) if profile else None
    n_params = sum(p.numel() for p in model.parameters())
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return losses, times, n_params, breakdown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU, emulated FP8")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--backend", default="auto", choices=["auto", "deep_gemm", "torch", "emulated"])
    ap.add_argument("--quant", default="auto", choices=["auto", "torch", "triton"],
                    help="quantizers: Triton on CUDA (auto) or the torch reference")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel breakdown (GPU)")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--profile", action="store_true", help="(default on the GPU; kept for old command lines)")
    ap.add_argument("--noise", action="store_true",
                    help="also train bf16 from another init seed: max|dL| between two bf16 runs, the scale of "
                         "run-to-run noise the FP8 difference is read against")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        args.steps, args.batch, args.seq = min(args.steps, 4), 2, 64
    runtime.IMPL["name"] = args.quant
    profile = (device.type == "cuda" or args.smoke) and not args.no_profile
    configs = {"dense": SMOKE_DENSE if args.smoke else DENSE_1B, "moe": SMOKE_MOE if args.smoke else MOE_SMALL}
    warm = min(10, args.steps // 2)
    results, curves, breakdowns = [], {}, {}
    for key in args.models.split(","):
        hf = configs[key]
        data = batches(hf["vocab_size"], args.batch, args.seq + 1, 8, seed=1)
        runs, prof = {}, {}
        for fp8 in (False, True):
            losses, times, n, prof[fp8] = train(hf, fp8, args.backend, data, args.steps, device, args.lr,
                                                profile=profile)
            runs[fp8] = (losses, times)
            tag = "fp8 " if fp8 else "bf16"
            print(f"{key} {tag} median step {median(times[warm:]) * 1e3:.1f} ms; loss every 10 steps: "
                  + " ".join(f"{x:.3f}" for x in losses[::10]) + f" ... last {losses[-1]:.4f}",
                  file=sys.stderr, flush=True)
        curves[f"{key} bf16"], curves[f"{key} fp8"] = runs[False][0], runs[True][0]
        diff = max(abs(a - b) for a, b in zip(runs[True][0], runs[False][0]))
        noise = float("nan")
        if args.noise:
            other, _, _, _ = train(hf, False, args.backend, data, args.steps, device, args.lr, seed=1)
            curves[f"{key} bf16 s1"] = other
            noise = max(abs(a - b) for a, b in zip(other, runs[False][0]))
        if profile:
            breakdowns[key] = prof
            print(f"\n{key}: top kernels of one FP8 step (GPU ms)", file=sys.stderr)
            for name, ms in prof[True]["top"]:
                print(f"  {ms:8.2f}  {name[:110]}", file=sys.stderr)
        results.append((key, n, args.batch * args.seq, median(runs[False][1][warm:]), median(runs[True][1][warm:]),
                        runs[False][0], runs[True][0], diff, noise))

    where = "CPU" if device.type == "cpu" else torch.cuda.get_device_name()
    print(f"\nLoss curves (every 5th step; 's1' = bf16 from init seed 1, the run-to-run noise)")
    names = list(curves)
    print(f"{'step':>4s} " + " ".join(f"{n:>13s}" for n in names))
    for i in list(range(0, args.steps, 5)) + ([args.steps - 1] if (args.steps - 1) % 5 else []):
        print(f"{i:4d} " + " ".join(f"{curves[n][i]:13.4f}" for n in names))
    for key, prof in breakdowns.items():
        print(f"\n{key}: device time of one step by kernel class (ms; profiled step, forward+backward+AdamW)")
        classes = sorted(set(prof[False]["classes"]) | set(prof[True]["classes"]))
        print(f"{'class':18s} {'bf16':>9s} {'fp8':>9s}")
        for c in classes + ["total"]:
            vb = sum(prof[False]["classes"].values()) if c == "total" else prof[False]["classes"].get(c, 0.0)
            vf = sum(prof[True]["classes"].values()) if c == "total" else prof[True]["classes"].get(c, 0.0)
            print(f"{c:18s} {vb:9.2f} {vf:9.2f}")
    quant = args.quant + (f" -> torch after Triton failed: {runtime.IMPL['failed']}" if "failed" in runtime.IMPL else "")
    print(f"\nTraining step, FP8 (backend {args.backend}, quantizers {quant}) vs bf16, {args.steps} steps, "
          f"{where}, torch {torch.__version__}")
    print(f"{'model':6s} {'params':>8s} {'tok/step':>9s} {'bf16 ms':>9s} {'fp8 ms':>9s} {'speedup':>8s} "
          f"{'loss0':>7s} {'bf16 last':>10s} {'fp8 last':>9s} {'max|dL|':>8s} {'bf16 seeds max|dL|':>19s}")
    for key, n, tok, tb, tf, lb, lf, diff, noise in results:
        print(f"{key:6s} {n / 1e9:7.2f}B {tok:9d} {tb * 1e3:9.1f} {tf * 1e3:9.1f} {tb / tf:8.2f} "
              f"{lb[0]:7.3f} {lb[-1]:10.4f} {lf[-1]:9.4f} {diff:8.4f} {noise:19.4f}")


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


if __name__ == "__main__":
    main()
