"""What model.batch_invariant costs: engine decode and a trainer step, default vs invariant, side by side.

    python bench/batch_invariant_speed.py [--dtype float32] [--reps 3] [--smoke]

Engine: the native engine generates ``--tokens`` tokens for ``--seqs`` sequences at once
(one prompt each, 12..20 tokens) and for a single sequence (where padding the linears to 16
rows costs most); reported as generated tokens/s. Trainer: forward + backward of one packed
row of ``--row`` tokens (documents of 48 tokens; attention ``sdpa`` against ``invariant``,
chunked logprobs) in seconds. Times are the process's CPU time (``--threads``, default 1), so
that other load on a shared machine inflates them less. Arms alternate, ``--reps`` times
each; the best run counts.
Random tiny-llama weights (recipes/models/tiny-llama).
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlcli.infer.engine import NativeEngine  # noqa: E402
from rlcli.models import DTYPES, load_model  # noqa: E402
from rlcli.ops.attention import ForwardContext, PackedCausalAttention  # noqa: E402
from rlcli.ops.batch_invariant import pad_linear_rows  # noqa: E402
from rlcli.ops.logprobs import chunked_logprobs  # noqa: E402
from rlcli.protocol import GenerateRequest, SamplingParams  # noqa: E402


def model_for(dtype: torch.dtype, invariant: bool):
    model = load_model(os.path.join(ROOT, "recipes/models/tiny-llama"), seed=0)
    model.init_weights(seed=0, std=0.1)
    model = model.to(dtype)
    if invariant:
        pad_linear_rows(model)
    return model


def engine_tok_s(dtype, invariant: bool, seqs: int, tokens: int) -> float:
    model = model_for(dtype, invariant).eval()
    engine = NativeEngine(model, eos_token_ids=[257], max_model_len=256, kv_cache_memory_mb=32, seed=0,
                          batch_invariant=invariant)
    g = torch.Generator().manual_seed(0)
    for i in range(seqs):
        prompt = torch.randint(0, 256, (int(torch.randint(12, 21, (1,), generator=g)),), generator=g).tolist()
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=prompt, sampling=SamplingParams(
            max_tokens=tokens, seed=i, ignore_eos=True)))
    engine.step()  # the prefill
    start = time.process_time()
    while engine.has_work():
        engine.step()
    return seqs * (tokens - 1) / (time.process_time() - start)


def train_s(dtype, invariant: bool, row: int) -> float:
    model = model_for(dtype, invariant)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, row), generator=g)
    pos = (torch.arange(row) % 48)[None]
    start = time.process_time()
    attn = PackedCausalAttention(pos, backend="invariant" if invariant else "sdpa")
    h = model.hidden_states(ids, pos, ForwardContext(attn=attn))[0]
    lp, _ = chunked_logprobs(h[:-1], model.lm_head.weight, ids[0, 1:], 1.0)
    lp.sum().backward()
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--row", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one rep (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:
        args.seqs, args.tokens, args.row, args.reps = 2, 4, 96, 1
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    cases = [(f"engine decode, {args.seqs} seqs (tok/s per CPU s)",
              lambda inv: engine_tok_s(dtype, inv, args.seqs, args.tokens), max),
             ("engine decode, 1 seq (tok/s per CPU s)", lambda inv: engine_tok_s(dtype, inv, 1, args.tokens), max),
             (f"trainer fwd+bwd, {args.row}-token row (CPU s)", lambda inv: train_s(dtype, inv, args.row), min)]
    rows = []
    for name, fn, best in cases:
        runs = {False: [], True: []}
        for _ in range(args.reps):
            for inv in (False, True):
                runs[inv].append(fn(inv))
        rows.append((name, best(runs[False]), best(runs[True])))
        print(f"done {name}", file=sys.stderr, flush=True)
    print(f"\nmodel.batch_invariant cost, random tiny-llama, {args.dtype}, {torch.get_num_threads()} threads")
    print(f"{'':40s} {'default':>10s} {'invariant':>10s} {'invariant/default':>18s}")
    for name, base, inv in rows:
        print(f"{name:40s} {base:10.3f} {inv:10.3f} {inv / base:18.2f}")


if __name__ == "__main__":
    main()
