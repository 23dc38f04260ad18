"""Train/inference mismatch with FP8 on both sides against bf16 (and fp32) on both sides.

    python bench/fp8_mismatch.py [--model DIR | --shape tiny|moe|1b|moe-1b] [--prompts 32] [--device cuda]

The same weights are loaded twice per numeric mode: as the native inference engine loads
them (rl-infer; with FP8, weights held as FP8 + scales) and as the trainer does (rl-train;
with FP8, master weights quantized on the fly). The engine samples completions with their
logprobs; the trainer recomputes the logprobs of the same tokens (one packed forward per
sequence, as in training). Reported per mode: the k3 estimate of KL(pi_infer || pi_train)
per completion token (the trainer's mismatch_kl metric) and the largest |logprob gap|.
Without --model it uses recipes/models/tiny-llama with random weights (std 0.1, so the
distributions are not flat); ``--shape moe`` recipes/models/tiny-qwen3-moe the same way (the
trainer routes by itself: no R3 here); ``--shape 1b`` a random Llama-3.2-1B body and
``--shape moe-1b`` a random Qwen3-MoE (hidden 1024, 8 layers, 32 experts top-4): bench/vllm_fp8.py's
dense and MoE models, default init.

Each mode runs twice: as before (engine: paged SDPA, sampler log_softmax; trainer: one
``model(ids)`` + log_softmax per sequence) and under ``model.batch_invariant`` (engine and
trainer both: linears on >= 16 rows, invariant attention, the trainer's chunked-logprob
formula; the trainer packs a prompt's completions into one row and scores them with
``chunked_logprobs``, as rl-train does). On CUDA the invariant path runs
:mod:`rlcli.ops.invariant_kernels` on both sides. Decode tokens/s of each engine and the
trainer's scoring time are printed beside.
"""

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlcli.infer.engine import NativeEngine  # noqa: E402
from rlcli.models import load_model, save_model  # noqa: E402
from rlcli.ops.attention import ForwardContext, PackedCausalAttention  # noqa: E402
from rlcli.ops import batch_invariant  # noqa: E402
from rlcli.ops.batch_invariant import make_batch_invariant  # noqa: E402
from rlcli.ops.logprobs import chunked_logprobs  # noqa: E402
from rlcli.protocol import GenerateRequest, SamplingParams  # noqa: E402
from rlcli.train.loss import token_logprobs  # noqa: E402

FP8 = SimpleNamespace(enabled=True, backend="auto", include=["*"], exclude=["*embed_tokens", "lm_head", "*.mlp.gate"],
                      ue8m0=False)
MODES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "fp8-fp32": (torch.float32, FP8),
         "fp8-bf16": (torch.bfloat16, FP8)}
SHAPES = {"tiny": "tiny-llama", "moe": "tiny-qwen3-moe (8 experts, top-2)", "1b": "Llama-3.2-1B body",
          "moe-1b": "Qwen3-MoE (hidden 1024, 8 layers, 32 experts top-4)"}
LABELS = {"fp32": "fp32", "bf16": "bf16", "fp8-fp32": "fp8 (fp32 master)", "fp8-bf16": "fp8 (bf16 master)"}


def trainer_logprobs(model, prompt: list[int], completions: list[list[int]], invariant: bool) -> list[torch.Tensor]:
    """The trainer's logprobs of each completion: per sequence ``model(ids)`` + log_softmax
    (the old arms), or the completions packed into one row, invariant attention and
    ``chunked_logprobs`` at the completion positions (rl-train's path, batch-invariant arms)."""
    dev = model.lm_head.weight.device
    if not invariant:
        out = []
        for c in completions:
            ids = torch.tensor([prompt + c], device=dev)
            lp, _ = token_logprobs(model(ids).float(), ids, 1.0)
            out.append(lp[0, len(prompt):].cpu())
        return out
    ids, pos, index, targets = [], [], [], []
    for c in completions:
        seq = prompt + c
        index += [len(ids) + len(prompt) - 1 + j for j in range(len(c))]
        targets += c
        ids += seq
        pos += range(len(seq))
    ids_t, pos_t = torch.tensor([ids], device=dev), torch.tensor([pos], device=dev)
    ctx = ForwardContext(attn=PackedCausalAttention(pos_t, backend="invariant"))
    h = model.hidden_states(ids_t, pos_t, ctx)[0]
    lp, _ = chunked_logprobs(h.index_select(0, torch.tensor(index, device=dev)), model.lm_head.weight,
                             torch.tensor(targets, device=dev), 1.0)
    return list(lp.cpu().split([len(c) for c in completions]))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model_dir: str, dtype, fp8, prompts: list[list[int]], n: int, max_tokens: int,
            invariant: bool, device: str) -> tuple[float, float, int, float, float]:
    batch_invariant.enable(invariant)  # rows_mm / row_sum; the engine switches it on again itself
    engine_model = load_model(model_dir, device=device, dtype=dtype, fp8=fp8, fp8_storage=True)
    trainer_model = load_model(model_dir, device=device, dtype=dtype, fp8=fp8).eval()
    if invariant:
        make_batch_invariant(trainer_model)
    max_len = max(map(len, prompts)) + max_tokens + 16
    engine = NativeEngine(engine_model, eos_token_ids=list(engine_model.args.eos_token_id), max_model_len=max_len,
                          kv_cache_memory_mb=16 if device == "cpu" else 8192, seed=0, batch_invariant=invariant)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, sampling=SamplingParams(
            temperature=1.0, max_tokens=max_tokens, n=n, seed=i)))
    responses = []
    start = time.perf_counter()
    while engine.has_work():
        responses.extend(engine.step())
    _sync(device)
    tok_s = engine.counters["num_generated_tokens"] / (time.perf_counter() - start)
    kl_sum, gap, count = 0.0, 0.0, 0
    start = time.perf_counter()
    with torch.no_grad():
        for r in responses:
            prompt = prompts[int(r.request_id)]
            lps = trainer_logprobs(trainer_model, prompt, [c.token_ids for c in r.completions], invariant)
            for c, lp in zip(r.completions, lps):
                log_r = lp.double() - torch.tensor(c.logprobs, dtype=torch.float64)
                kl_sum += float((log_r.exp() - 1 - log_r).sum())
                gap = max(gap, float(log_r.abs().max()))
                count += len(c.logprobs)
    score_s = time.perf_counter() - start
    del engine, engine_model, trainer_model
    if device != "cpu":
        torch.cuda.empty_cache()
    return kl_sum / max(count, 1), gap, count, tok_s, score_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF-layout model directory [default: random tiny-llama]")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    ap.add_argument("--paths", default="default,invariant", help="default, invariant or both (comma-separated)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny",
                    help="the random model without --model: " + ", ".join(f"{k} = {v}" for k, v in SHAPES.items()))
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None and args.shape in ("1b", "moe-1b"):
            from pathlib import Path

            from bench.vllm_fp8 import write_model

            model_dir = str(write_model(Path(tmp), "dense" if args.shape == "1b" else "moe", False, 4096))
        elif model_dir is None:
            name = "tiny-qwen3-moe" if args.shape == "moe" else "tiny-llama"
            model = load_model(os.path.join(ROOT, "recipes/models", name), seed=0)
            model.init_weights(seed=0, std=0.1)
            save_model(model, tmp)
            model_dir = tmp
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (int(torch.randint(4, 16, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(args.prompts)]
        rows = []
        for name in args.modes.split(","):
            dtype, fp8 = MODES[name]
            for path in args.paths.split(","):
                kl, gap, count, tok_s, score_s = measure(model_dir, dtype, fp8, prompts, args.n, args.max_tokens,
                                                         path == "invariant", args.device)
                rows.append((name, path, kl, gap, count, tok_s, score_s))
                print(f"done {name} {path}", file=sys.stderr, flush=True)
    what = args.model or "random " + SHAPES[args.shape]
    print(f"\nTrain/inference mismatch, native engine vs trainer forward, same weights ({what}, {args.device})")
    print(f"{'numerics (both sides)':22s} {'path':10s} {'KL/token (k3)':>14s} {'max |dlogp|':>12s} {'tokens':>7s} "
          f"{'engine tok/s':>12s} {'trainer s':>9s}")
    for name, path, kl, gap, count, tok_s, score_s in rows:
        print(f"{LABELS[name]:22s} {path:10s} {kl:14.3e} {gap:12.3e} {count:7d} {tok_s:12.1f} {score_s:9.2f}")


if __name__ == "__main__":
    main()
