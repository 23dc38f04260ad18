"""The native engine's paged attention on a GPU: varlen flash calls against SDPA.

Both arms run the same engine (``NativeEngine``, 1B Llama shape of ``bench/kv_cache.py``,
bf16, random weights) over the same requests, one after the other in one process: ``sdpa``
is the path the engine takes off CUDA (a batched, padded SDPA call for the decodes, one call
per prefill chunk; with grouped heads and a padding mask the decode call lands in cuDNN,
which builds a plan per new key length), ``varlen`` the CUDA path (flash varlen calls over
the gathered contexts: one for the decodes, their grouped heads folded into query rows, one
for the prefill chunks), ``paged`` the CUDA path with ``infer.engine.paged_decode`` (the
decodes read the cache in place through :mod:`rlcli.ops.paged_decode`; the prefill chunks as
in ``varlen``), ``graphs`` that path with its decode steps replayed as CUDA graphs
(``infer.engine.cuda_graphs``; the others run eagerly). Printed per arm: the prefill time
of all prompts (chunked, ``--chunk`` tokens a step, until every sequence has its first
token), the median decode step, and the ratios; then how many sequences' first (greedy)
token is the same as ``sdpa``'s and, over those, the largest gap between its logprobs (bf16
through 16 layers and 24k keys: near-ties of random weights may pick other tokens).

``--model dsv3-1.7b`` takes DeepSeek-V3's attention instead (recipes/models/dsv3-1.7b-random: MLA with
DeepSeek-V3's 512 + 64 latent, 16 heads, an MoE of 32 experts; random weights). Its layers attend in
latent form, outside the varlen path, so its arms are ``gather`` (paged_decode off: each decode's
context gathered from the cache, padded to the longest), ``paged`` and ``graphs``.

    python bench/paged_attention.py                       # 8 sequences of 24k tokens, 32 decode steps
    python bench/paged_attention.py --seqs 32 --context 8192
    python bench/paged_attention.py --model dsv3-1.7b
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_cache import LLAMA, SHAPES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

from rlcli.infer.engine import NativeEngine  # noqa: E402
from rlcli.models import DTYPES, load_model  # noqa: E402
from rlcli.ops.attention import PagedAttention  # noqa: E402
from rlcli.protocol import GenerateRequest, SamplingParams  # noqa: E402


def run_arm(model, args, prompts: list[list[int]], paged_decode: bool = False, cuda_graphs: bool = False) -> dict:
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=args.context + args.steps + 64, block_size=16,
                          kv_cache_memory_mb=args.kv_cache_mb, max_num_batched_tokens=args.chunk, seed=0,
                          max_num_seqs=max(args.seqs, 4), paged_decode=paged_decode, cuda_graphs=cuda_graphs)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=ids, sampling=SamplingParams(
            max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.waiting or any(s.num_generated == 0 for s in engine.running):  # prompts, chunk by chunk
        engine.step()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    first = {s.req.request_id: (s.tokens[-1], s.logprobs[-1]) for s in engine.running}
    steps = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
    engine.close()
    return {"prefill_s": prefill_s, "decode_step_s": statistics.median(steps), "first": first}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--context", type=int, default=24576, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--chunk", type=int, default=8192, help="tokens per prefill step (max_num_batched_tokens)")
    p.add_argument("--kv-cache-mb", type=int, default=32768)
    p.add_argument("--model", choices=["llama-1b", "dsv3-1.7b"], default="llama-1b")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/paged_attention.py measures the CUDA path: no CUDA device")
    d = Path(tempfile.mkdtemp())
    longest = {"max_position_embeddings": args.context + args.steps + 64}
    if args.model == "llama-1b":
        h, inter, layers, heads, kv, hd = SHAPES["1b"]
        cfg = {**LLAMA, "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
               "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, **longest}
        shape, arms = "1B Llama shape", ("sdpa", "varlen", "paged", "graphs")
    else:
        cfg = {**json.loads((REPO / "recipes" / "models" / "dsv3-1.7b-random" / "config.json").read_text()), **longest}
        shape, arms = "DeepSeek-V3 MLA (dsv3-1.7b-random)", ("gather", "paged", "graphs")
    (d / "config.json").write_text(json.dumps(cfg))
    model = load_model(d, device=torch.device("cuda"), dtype=DTYPES["bfloat16"], seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.context,), generator=g).tolist() for _ in range(args.seqs)]
    varlen_gate = PagedAttention._use_varlen
    # Warm-up: kernels, allocator (the paged decode kernel compiles in the engine's own warm_up, at construction)
    run_arm(model, args, [p[:2048] for p in prompts[:2]])
    results = {}
    for arm in arms:
        PagedAttention._use_varlen = (lambda self, *a: False) if arm == "sdpa" else varlen_gate
        results[arm] = run_arm(model, args, prompts, paged_decode=arm in ("paged", "graphs"),
                               cuda_graphs=arm == "graphs")
    PagedAttention._use_varlen = varlen_gate
    print(f"# paged attention, {args.seqs} sequences x {args.context} prompt tokens, {shape}, bf16, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'arm':8} {'prefill s':>10} {'decode step ms':>15}")
    for arm, r in results.items():
        print(f"{arm:8} {r['prefill_s']:10.2f} {r['decode_step_s'] * 1e3:15.1f}")
    pairs = ((("varlen", "sdpa"), ("paged", "sdpa"), ("paged", "varlen"), ("graphs", "paged")) if "sdpa" in arms
             else (("paged", "gather"), ("graphs", "paged")))
    for name, base in pairs:
        v, b = results[name], results[base]
        same = [k for k in b["first"] if b["first"][k][0] == v["first"][k][0]]
        gap = max((abs(b["first"][k][1] - v["first"][k][1]) for k in same), default=float("nan"))
        print(f"{name} / {base}: prefill {b['prefill_s'] / v['prefill_s']:.2f}x faster, decode step "
              f"{b['decode_step_s'] / v['decode_step_s']:.2f}x faster; first greedy token equal in "
              f"{len(same)}/{len(b['first'])} sequences, largest gap between their logprobs {gap:.2e}")


if __name__ == "__main__":
    main()
