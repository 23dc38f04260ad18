"""A full training step (forward + backward + AdamW) in FP8 against bf16, same model, same data.

    python bench/fp8_train_step.py                 # H200: ~1B dense Llama and a small Qwen3-MoE, 50 steps each
    python bench/fp8_train_step.py --smoke         # CPU: tiny models, emulated FP8, 6 steps

Each model is built twice from the same seed (bf16 parameters on GPU, fp32 on CPU; AdamW), once left as is and
once passed through ``convert_to_fp8`` (every Linear except lm_head, plus the stacked
experts; router and embeddings stay bf16). The bf16 MoE baseline is the model's own grouped
experts (one bf16 grouped GEMM per projection). Both train on the same sequence of batches
(a fixed pool of token sequences made of repeated random motifs, so the loss falls within
50 steps). It prints the median step time of each (after warm-up: DeepGEMM JIT-compiles
every new shape, 5-9 s each, in the first steps), the speed-up, and both loss curves
(every 10th step, the last value, and the largest |loss_fp8 - loss_bf16| over all steps).
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
from rlcli.ops.fp8.linear import compile_quantizers  # noqa: E402

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
    if profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            ids = data[0].to(device)
            F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten()).backward()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70),
              file=sys.stderr)
    n_params = sum(p.numel() for p in model.parameters())
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return losses, times, n_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU, emulated FP8")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--backend", default="auto", choices=["auto", "deep_gemm", "torch", "emulated"])
    ap.add_argument("--no-compile", action="store_true", help="eager quantizers (default: torch.compile on GPU)")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one FP8 step (GPU)")
    ap.add_argument("--noise", action="store_true",
                    help="also train bf16 from another init seed: max|dL| between two bf16 runs, the scale of "
                         "run-to-run noise the FP8 difference is read against")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        args.steps, args.batch, args.seq = min(args.steps, 4), 2, 64
    if device.type == "cuda" and not args.no_compile:
        torch._dynamo.config.cache_size_limit = 64
        compile_quantizers()
    configs = {"dense": SMOKE_DENSE if args.smoke else DENSE_1B, "moe": SMOKE_MOE if args.smoke else MOE_SMALL}
    warm = min(10, args.steps // 2)
    results = []
    for key in args.models.split(","):
        hf = configs[key]
        data = batches(hf["vocab_size"], args.batch, args.seq + 1, 8, seed=1)
        runs = {}
        for fp8 in (False, True):
            losses, times, n = train(hf, fp8, args.backend, data, args.steps, device, args.lr,
                                     profile=args.profile and fp8)
            runs[fp8] = (losses, times)
            tag = "fp8 " if fp8 else "bf16"
            print(f"{key} {tag} loss every 10 steps: " + " ".join(f"{x:.3f}" for x in losses[::10])
                  + f" ... last {losses[-1]:.4f}", file=sys.stderr, flush=True)
        med = {k: sorted(t[warm:])[len(t[warm:]) // 2] for k, (_, t) in runs.items()}
        diff = max(abs(a - b) for a, b in zip(runs[True][0], runs[False][0]))
        noise = float("nan")
        if args.noise:
            other, _, _ = train(hf, False, args.backend, data, args.steps, device, args.lr, seed=1)
            print(f"{key} bf16 (init seed 1) loss every 10 steps: " + " ".join(f"{x:.3f}" for x in other[::10])
                  + f" ... last {other[-1]:.4f}", file=sys.stderr, flush=True)
            noise = max(abs(a - b) for a, b in zip(other, runs[False][0]))
        results.append((key, n, args.batch * args.seq, med[False], med[True], runs[False][0], runs[True][0], diff,
                        noise))

    print(f"\nTraining step, FP8 (backend {args.backend}) vs bf16, {args.steps} steps, "
          f"{'CPU' if device.type == 'cpu' else torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'model':6s} {'params':>8s} {'tok/step':>9s} {'bf16 ms':>9s} {'fp8 ms':>9s} {'speedup':>8s} "
          f"{'loss0':>7s} {'bf16 last':>10s} {'fp8 last':>9s} {'max|dL|':>8s} {'bf16 seeds max|dL|':>19s}")
    for key, n, tok, tb, tf, lb, lf, diff, noise in results:
        print(f"{key:6s} {n / 1e9:7.2f}B {tok:9d} {tb * 1e3:9.1f} {tf * 1e3:9.1f} {tb / tf:8.2f} "
              f"{lb[0]:7.3f} {lb[-1]:10.4f} {lf[-1]:9.4f} {diff:8.4f} {noise:19.4f}")


if __name__ == "__main__":
    main()
