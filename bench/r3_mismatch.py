"""Trainer/inference mismatch on a MoE model, with and without routing replay (R3), side by side.

The inference side is an rl-infer engine serving the model in bf16 (``--engine native``:
continuous batching, paged KV cache; ``--engine vllm``: vLLM with
``enable_return_routed_experts``, CUDA only), routes recorded for every prompt and
completion token; the trainer side
is the same weights in fp32, recomputing the logprob of every completion token from the
packed batch, once routing by itself and once replaying the engine's routes. Per side it
prints the mismatch KL (k3 estimator of KL(pi_infer || pi_train), mean over completion
tokens), the fraction of extreme tokens (ratio > 2 or < 0.5), mean |d logprob| and the
router disagreement rate (token-layer pairs whose top-k differs from the engine's; under
replay, computed from the trainer's own router scores, as rl-train logs it), then the
ratio KL(no R3) / KL(R3).

Random weights give near-uniform routers and logits; ``--init-std`` spreads them so the
model is as peaked as a trained one (routing decisions matter, logprobs are far from uniform).

    python bench/r3_mismatch.py --smoke                 # CPU, seconds
    python bench/r3_mismatch.py                         # CPU, the recipe's tiny Qwen3-MoE
    python bench/r3_mismatch.py --device cuda --hidden 1024 --experts 64 --layers 8   # one GPU
    python bench/r3_mismatch.py --device cuda --engine vllm --hidden 1024 --experts 64 --layers 8
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlcli.config import load_recipe  # noqa: E402
from rlcli.infer.base import Engine  # noqa: E402
from rlcli.infer.engine import NativeEngine  # noqa: E402
from rlcli.infer.factory import make_engine  # noqa: E402
from rlcli.models import load_model, save_model  # noqa: E402
from rlcli.models.moe import check_routes  # noqa: E402
from rlcli.ops.attention import ForwardContext, PackedCausalAttention, RoutingContext  # noqa: E402
from rlcli.protocol import GenerateRequest, SamplingParams  # noqa: E402
from rlcli.protocol.batch import Sample, build_micro_batch  # noqa: E402
from rlcli.train.loss import token_logprobs  # noqa: E402

BASE = Path(__file__).resolve().parent.parent / "recipes" / "models" / "tiny-qwen3-moe" / "config.json"


def make_model_dir(args) -> Path:
    cfg = json.loads(BASE.read_text())
    if args.hidden:
        cfg.update(hidden_size=args.hidden, head_dim=args.hidden // cfg["num_attention_heads"],
                   moe_intermediate_size=args.hidden // 2, intermediate_size=args.hidden * 2)
    if args.experts:
        cfg["num_experts"] = args.experts
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    cfg["num_experts_per_tok"] = args.top_k
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], args.prompt_len + args.max_tokens + 1)
    d = Path(tempfile.mkdtemp(prefix="r3-mismatch-"))
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer_config.json").write_text((BASE.parent / "tokenizer_config.json").read_text())
    return d


def generate(engine: Engine, args, rng: np.random.Generator, vocab: int) -> list[tuple[list[int], object]]:
    """(prompt, completion) pairs sampled by the bf16 engine, routes recorded."""
    prompts, out = {}, []
    for i in range(args.prompts):
        prompts[str(i)] = rng.integers(0, vocab, args.prompt_len).tolist()
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=prompts[str(i)], sampling=SamplingParams(
            temperature=1.0, max_tokens=args.max_tokens, n=args.n, return_routing=True, ignore_eos=True, seed=i)))
    while engine.has_work():
        for resp in engine.step():
            out += [(prompts[resp.request_id], c) for c in resp.completions]
    return out


def measure(model, pairs, device, replay: bool) -> dict[str, float]:
    kl = extreme = diff = tokens = 0.0
    disagree = pairs_counted = 0.0
    for prompt, c in pairs:
        s = Sample(token_ids=prompt + c.token_ids, num_prompt_tokens=len(prompt), advantage=0.0,
                   logprobs=c.logprobs, versions=c.versions, routed_experts=c.routed_experts)
        mb = build_micro_batch([s], temperature=1.0)
        ids = torch.from_numpy(mb.input_ids.numpy().astype(np.int64))[None].to(device)
        pos = torch.from_numpy(mb.position_ids.numpy().astype(np.int64))[None].to(device)
        routes = torch.from_numpy(mb.routed_experts.numpy().astype(np.int64)).to(device)
        check_routes(routes, model.args, ids.shape[1])
        counted = torch.ones(ids.shape[1], dtype=torch.bool, device=device)
        counted[-1] = False  # the last token's route is filler (never computed by the engine)
        routing = RoutingContext(replay=routes, counted=counted) if replay else RoutingContext(record=True)
        with torch.no_grad():
            logits = model(ids, pos, ForwardContext(attn=PackedCausalAttention(pos), routing=routing))
        lp, _ = token_logprobs(logits, ids, 1.0)
        lp = lp[0, len(prompt):].double().cpu()
        log_ratio = lp - torch.tensor(c.logprobs, dtype=torch.float64)
        ratio = log_ratio.exp()
        kl += float((ratio - 1 - log_ratio).sum())
        extreme += float(((ratio > 2) | (ratio < 0.5)).sum())
        diff += float(log_ratio.abs().sum())
        tokens += len(c.token_ids)
        if replay:
            disagree += float(routing.num_disagree)
            pairs_counted += float(routing.num_pairs)
        else:
            own = routing.stacked()[:-1].sort(-1)[0]
            disagree += float((own != routes[:-1].sort(-1)[0]).any(-1).sum())
            pairs_counted += own.shape[0] * own.shape[1]
    return {"mismatch_kl": kl / tokens, "extreme_fraction": extreme / tokens, "logprob_diff_abs_mean": diff / tokens,
            "router_disagreement": disagree / max(pairs_counted, 1), "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine", choices=["native", "vllm"], default="native",
                   help="The inference side (vllm records routes on CUDA only).")
    p.add_argument("--smoke", action="store_true", help="A few short completions (checks the script runs).")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="Completions per prompt.")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=0, help="Hidden size (0: the recipe's tiny Qwen3-MoE).")
    p.add_argument("--experts", type=int, default=0, help="Routed experts (0: the recipe's).")
    p.add_argument("--layers", type=int, default=0, help="Layers (0: the recipe's).")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--init-std", type=float, default=0.08, help="Std of the random weights.")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="The engine's KV cache.")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.smoke:
        args.prompts, args.n, args.max_tokens, args.prompt_len = 4, 2, 16, 16
    if args.engine == "vllm" and not args.device.startswith("cuda"):
        sys.exit("vLLM records MoE routes on CUDA only: pass --device cuda, or --engine native")
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model_dir = make_model_dir(args)
    trainer = load_model(model_dir, device, torch.float32, args.seed)
    with torch.no_grad():
        for name, param in trainer.named_parameters():
            if "norm" not in name:
                param.normal_(0, args.init_std)
    infer = load_model(model_dir, device, torch.bfloat16, args.seed)
    infer.load_state_dict({k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()})
    a = trainer.args
    print(f"model: qwen3_moe hidden {a.hidden_size}, {a.num_hidden_layers} layers, {a.num_experts} experts top-"
          f"{a.num_experts_per_tok}; inference bf16 ({args.engine} engine), trainer fp32; device {device}",
          file=sys.stderr)
    t0 = time.monotonic()
    max_len = args.prompt_len + args.max_tokens + 1
    if args.engine == "native":
        engine = NativeEngine(infer, eos_token_ids=[], max_model_len=max_len, seed=args.seed,
                              kv_cache_memory_mb=args.kv_cache_mb)
    else:  # the same bf16 weights, written as a checkpoint vLLM loads
        weights = model_dir / "bf16"
        save_model(infer, weights, source_dir=model_dir)
        del infer
        cfg = load_recipe(None, {"model.path": str(weights), "model.max_seq_len": max_len, "model.dtype": "bfloat16",
                                 "infer.engine.name": "vllm", "infer.device": args.device, "seed": args.seed,
                                 "infer.engine.gpu_memory_utilization": 0.5})  # the trainer's copy shares the GPU
        engine = make_engine(cfg, weights, version=0)
    pairs = generate(engine, args, np.random.default_rng(args.seed), a.vocab_size)
    gen_s = time.monotonic() - t0
    results = {"without R3": measure(trainer, pairs, device, replay=False),
               "with R3": measure(trainer, pairs, device, replay=True)}
    print(f"{len(pairs)} completions, {int(results['with R3']['tokens'])} tokens, generated in {gen_s:.1f}s",
          file=sys.stderr)
    print(f"{'':<12}{'mismatch KL':>13}{'extreme':>10}{'|dlogp|':>10}{'router disagree':>17}")
    for name, r in results.items():
        print(f"{name:<12}{r['mismatch_kl']:>13.3e}{r['extreme_fraction']:>10.4f}{r['logprob_diff_abs_mean']:>10.4f}"
              f"{r['router_disagreement']:>17.4f}")
    ratio = results["without R3"]["mismatch_kl"] / max(results["with R3"]["mismatch_kl"], 1e-30)
    print(f"KL without R3 / KL with R3: {ratio:.1f}x (goal >= 10x)")
    print(json.dumps({k: {m: float(v) for m, v in r.items()} for k, r in results.items()}))


if __name__ == "__main__":
    main()
