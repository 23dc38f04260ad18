"""What model.batch_invariant costs: engine decode and a trainer step, default vs invariant, side by side.

    python bench/batch_invariant_speed.py [--dtype float32] [--reps 3] [--smoke]
    python bench/batch_invariant_speed.py --device cuda --shape 1b|moe-1b --dtype bfloat16 [--fp8]

Engine: the native engine generates ``--tokens`` tokens for ``--seqs`` sequences at once
(one prompt each, 12..20 tokens) and for a single sequence (where padding the linears to 16
rows costs most); reported as generated tokens/s. Trainer: forward + backward of one packed
row of ``--row`` tokens (documents of ``--doc`` tokens; attention ``sdpa`` (CPU) or ``auto``
(CUDA) against ``invariant``, chunked logprobs) in seconds. On the CPU times are the
process's CPU time (``--threads``, default 1), so that other load on a shared machine
inflates them less; on CUDA wall time after a synchronize, where the invariant arm runs
:mod:`rlcli.ops.invariant_kernels`. Arms alternate, ``--reps`` times each; the best run counts.
Random tiny-llama weights (recipes/models/tiny-llama), or with ``--shape 1b`` a Llama-3.2-1B
body and with ``--shape moe-1b`` a Qwen3-MoE of hidden 1024, 8 layers, 32 experts top-4
(bench/vllm_fp8.py's dense and MoE models).
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlcli.infer.engine import NativeEngine  # noqa: E402
from rlcli.models import DTYPES, load_model  # noqa: E402
from rlcli.ops.attention import ForwardContext, PackedCausalAttention  # noqa: E402
from rlcli.ops import batch_invariant  # noqa: E402
from rlcli.ops.batch_invariant import make_batch_invariant  # noqa: E402
from rlcli.ops.logprobs import chunked_logprobs  # noqa: E402
from rlcli.protocol import GenerateRequest, SamplingParams  # noqa: E402


ARGS = argparse.Namespace(device="cpu", model_dir=None, fp8=False)
FP8 = SimpleNamespace(enabled=True, backend="auto", include=["*"], exclude=["*embed_tokens", "lm_head", "*.mlp.gate"],
                      ue8m0=False)
SHAPES = {"tiny": "tiny-llama", "1b": "Llama-3.2-1B body", "moe-1b": "Qwen3-MoE (hidden 1024, 8 layers, 32 experts top-4)"}


def clock() -> float:
    """CPU time of this process on the CPU; wall time after a synchronize on CUDA."""
    if ARGS.device == "cpu":
        return time.process_time()
    torch.cuda.synchronize()
    return time.perf_counter()


def model_for(dtype: torch.dtype, invariant: bool):
    batch_invariant.enable(invariant)
    fp8 = FP8 if ARGS.fp8 else None
    if ARGS.model_dir is None:
        model = load_model(os.path.join(ROOT, "recipes/models/tiny-llama"), seed=0, fp8=fp8)
        model.init_weights(seed=0, std=0.1)
        model = model.to(device=ARGS.device, dtype=dtype)
    else:
        model = load_model(ARGS.model_dir, device=ARGS.device, dtype=dtype, fp8=fp8)
    if invariant:
        make_batch_invariant(model)
    return model


def engine_tok_s(dtype, invariant: bool, seqs: int, tokens: int) -> float:
    model = model_for(dtype, invariant).eval()
    engine = NativeEngine(model, eos_token_ids=[257], max_model_len=256,
                          kv_cache_memory_mb=32 if ARGS.device == "cpu" else 4096, seed=0, batch_invariant=invariant)
    g = torch.Generator().manual_seed(0)
    for i in range(seqs):
        prompt = torch.randint(0, 256, (int(torch.randint(12, 21, (1,), generator=g)),), generator=g).tolist()
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=prompt, sampling=SamplingParams(
            max_tokens=tokens, seed=i, ignore_eos=True)))
    engine.step()  # the prefill
    start = clock()
    while engine.has_work():
        engine.step()
    return seqs * (tokens - 1) / (clock() - start)


def train_s(dtype, invariant: bool, row: int, doc: int) -> float:
    model = model_for(dtype, invariant)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, row), generator=g).to(ARGS.device)
    pos = (torch.arange(row) % doc)[None]
    start = clock()
    attn = PackedCausalAttention(pos, backend="invariant" if invariant else "sdpa" if ARGS.device == "cpu" else "auto",
                                 device=ARGS.device)
    pos = pos.to(ARGS.device)
    h = model.hidden_states(ids, pos, ForwardContext(attn=attn))[0]
    lp, _ = chunked_logprobs(h[:-1], model.lm_head.weight, ids[0, 1:], 1.0)
    lp.sum().backward()
    return clock() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--row", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--doc", type=int, default=48, help="document length in the trainer's row")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny")
    ap.add_argument("--fp8", action="store_true", help="FP8 linears (engine and trainer)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one rep (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:
        args.seqs, args.tokens, args.row, args.reps = 2, 4, 96, 1
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    ARGS.device, ARGS.fp8 = args.device, args.fp8
    unit = "CPU s" if args.device == "cpu" else "s"
    cases = [(f"engine decode, {args.seqs} seqs (tok/s per {unit})",
              lambda inv: engine_tok_s(dtype, inv, args.seqs, args.tokens), max),
             (f"engine decode, 1 seq (tok/s per {unit})", lambda inv: engine_tok_s(dtype, inv, 1, args.tokens), max),
             (f"trainer fwd+bwd, {args.row}-token row ({unit})", lambda inv: train_s(dtype, inv, args.row, args.doc),
              min)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape != "tiny":
            from bench.vllm_fp8 import write_model

            ARGS.model_dir = write_model(Path(tmp), "dense" if args.shape == "1b" else "moe", False, 4096)
        for name, fn, best in cases:
            runs = {False: [], True: []}
            for _ in range(args.reps):
                for inv in (False, True):
                    runs[inv].append(fn(inv))
            rows.append((name, best(runs[False]), best(runs[True])))
            print(f"done {name}", file=sys.stderr, flush=True)
    what = "random " + SHAPES[args.shape]
    print(f"\nmodel.batch_invariant cost, {what}, {args.dtype}{', FP8' if args.fp8 else ''}, {args.device}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'':40s} {'default':>10s} {'invariant':>10s} {'invariant/default':>18s}")
    for name, base, inv in rows:
        print(f"{name:40s} {base:10.3f} {inv:10.3f} {inv / base:18.2f}")


if __name__ == "__main__":
    main()
