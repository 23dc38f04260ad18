"""The native engine on a device, checked against a full forward and timed.

For each dtype: greedy completions of the paged engine (with and without forced
preemption) against a dense, full-sequence greedy loop of the same model on the same
device (the baseline: what the engine must reproduce), then engine throughput at a few
batch sizes with fixed output lengths (ignore_eos, temperature 1). Random weights in the
shape of SmolLM2-135M. Prints one table: token agreement, the largest logprob gap before
the first divergence, preemptions, and tok/s of the engine against the dense loop.

    python bench/native_engine_device.py                   # CUDA: fp32 and bf16, batch 1, 16, 128
    python bench/native_engine_device.py --smoke           # CPU, tiny shape, a few tokens
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from rlcli.infer.engine import NativeEngine, resolve_device
from rlcli.models import DTYPES, load_model
from rlcli.protocol import GenerateRequest, SamplingParams

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
TINY = {**SMOLLM2, "vocab_size": 259, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(engine: NativeEngine, prompts: list[list[int]], sampling: SamplingParams) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, sampling=sampling))
    out = {}
    while engine.has_work():
        for r in engine.step():
            out[int(r.request_id)] = r.completions[0]
    return out


@torch.no_grad()
def dense_greedy(model, prompts: list[list[int]], num_new: int, device) -> list[tuple[list[int], list[float]]]:
    """Baseline: the full sequence through the model at every step, batched (prompts of equal length)."""
    ids = torch.tensor(prompts, device=device)
    lps = []
    for _ in range(num_new):
        logits = model(ids)[:, -1].float()
        lp = torch.log_softmax(logits, -1)
        nxt = logits.argmax(-1)
        lps.append(lp.gather(1, nxt[:, None])[:, 0])
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    lps_t = torch.stack(lps, 1).tolist()
    return [(row[len(prompts[0]):], lp) for row, lp in zip(ids.tolist(), lps_t)]


def agreement(engine_out: dict, ref: list) -> tuple[float, float]:
    """Fraction of generated tokens equal to the reference, and the largest |logprob gap| up to
    each completion's first divergence."""
    same = total = 0
    gap = 0.0
    for i, (toks, lps) in enumerate(ref):
        c = engine_out[i]
        for t_e, t_r, lp_e, lp_r in zip(c.token_ids, toks, c.logprobs, lps):
            total += 1
            if t_e != t_r:
                break
            same += 1
            gap = max(gap, abs(lp_e - lp_r))
        total += len(toks) - min(len(toks), len(c.token_ids))
    return same / max(total, 1), gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 128])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, few tokens")
    args = ap.parse_args()
    shape = SMOLLM2
    if args.smoke:
        shape, args.device, args.dtypes, args.batches, args.prompt_len, args.new_tokens = (
            TINY, "cpu", ["float32"], [1, 4], 16, 8)
    device = resolve_device(args.device)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(shape))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in args.dtypes:
        model = load_model(tmp, device=device, dtype=DTYPES[dtype], seed=0)
        num_check = 8
        prompts = torch.randint(3, shape["vocab_size"], (max(args.batches + [num_check]), args.prompt_len),
                                generator=gen).tolist()
        ref = dense_greedy(model, prompts[:num_check], args.new_tokens, device)
        greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        per_token_kb = sum(h * d for layer in model.kv_cache_spec() for h, d in layer) * DTYPES[dtype].itemsize / 1024
        for label, kv_mb in [("plenty", 2048.0), ("preempting", 3 * (args.prompt_len + args.new_tokens)
                                                  * per_token_kb / 1024)]:
            engine = NativeEngine(model, eos_token_ids=[], max_model_len=args.prompt_len + args.new_tokens + 1,
                                  kv_cache_memory_mb=kv_mb)
            same, gap = agreement(run(engine, prompts[:num_check], greedy), ref)
            rows.append((dtype, f"greedy vs dense, {label} KV", f"{same:.1%} tokens", f"{gap:.2e}",
                         str(int(engine.stats()["num_preemptions"])), "", "", ""))
            engine.close()
        for b in args.batches:
            engine = NativeEngine(model, eos_token_ids=[], max_model_len=args.prompt_len + args.new_tokens + 1,
                                  kv_cache_memory_mb=4096.0 if device.type == "cuda" else 256.0, max_num_seqs=b)
            sampling = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=None)
            run(engine, prompts[:b], SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True))  # warm-up
            sync(device)
            t0 = time.perf_counter()
            out = run(engine, prompts[:b], sampling)
            sync(device)
            dt = time.perf_counter() - t0
            engine.close()
            tokens = sum(len(c.token_ids) for c in out.values())
            sync(device)
            t0 = time.perf_counter()
            dense_greedy(model, prompts[:b], args.new_tokens, device)
            sync(device)
            dense_dt = time.perf_counter() - t0
            rows.append((dtype, f"throughput, batch {b}", "", "", "", f"{tokens / dt:,.0f}",
                         f"{tokens / dense_dt:,.0f}", f"{dense_dt / dt:.2f}x"))
        del model
    name = "tiny" if args.smoke else "SmolLM2-135M shape"
    print(f"\nnative engine on {device} ({name}, prompts {args.prompt_len}, {args.new_tokens} new tokens)")
    head = ("dtype", "check", "agreement", "max |dlogprob|", "preempt", "engine tok/s", "dense tok/s", "ratio")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))


if __name__ == "__main__":
    main()
