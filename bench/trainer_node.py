"""rl-train alone on one node: `rl-train --ep E --cp C`, FP8 against bf16, side by side.

#16's first run (`rl-train --fp8 --ep 8 --cp 4` on 8 GPUs, a DeepSeek-V3-style MoE of 2-8B
parameters at 32k context), at whatever size the machine allows. Each arm is the real
trainer: this script writes --steps synthetic RL batches (rows of --seq tokens, a
--prompt-token prompt and one completion of random tokens, advantages +-1, inference
logprobs -ln V: what a random-weight model gives, so the importance ratios stay near 1)
into a fresh run directory with a config-only model (random weights from the seed; compute in
--dtype, model.dtype: bfloat16 unless --smoke), then
runs `python -m rlcli.cli.train run --nproc-per-node W --ep E --cp C [--fp8]` over them with
the collective weight backend (no rl-sync is started: each step stages its weights for a
broadcast nobody asks for, and only policy 0 is written to disk), full activation checkpointing and
step --profile-step (default: the last) profiled (train.profile_step). Per step it prints the
compute time, the graphs torch.compile built in it (a recompile, after the first steps) and the
frames it gave up on (they run eagerly from then on); after the profiled step, its largest device kernels (host
ops on a CPU) from rank 0's trace. From the trainer's own metrics it prints per
arm: tokens/s (trained row tokens over the median compute time of the steps after the
first two), MFU against --peak-tflops (bf16 dense; the FP8 arm against the same peak),
peak memory per GPU, and the profiled step's collective time by kind over the median
unprofiled step time (device kernel time on GPUs, which the profiler does not slow; it
overlaps compute, so it bounds the cost from above).

    python bench/trainer_node.py --nproc 2 --ep 2 --cp 2                    # two H200s
    python bench/trainer_node.py --nproc 8 --ep 8 --cp 4                    # one 8-GPU node
    python bench/trainer_node.py --smoke                                     # CPU, gloo, tiny
    python bench/trainer_node.py --smoke --seq 4096 --steps 4                # CPU, longer rows
    python bench/trainer_node.py --model llama-1b --nproc 1 --ep 1 --cp 1    # #11's ~1B dense step, one H200

Model FLOPs per token: 6 x (matmul parameters a token passes through: attention, dense and
shared MLPs, top-k of the routed experts, the router and LM head) + causal attention,
6 x layers x heads x (qk_head_dim + v_head_dim) x seq / 2.
"""

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DSV3_4B = dict(model_type="deepseek_v3", vocab_size=32768, hidden_size=2048, intermediate_size=10944,
               num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=16, q_lora_rank=1536,
               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
               n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, scoring_func="sigmoid",
               topk_method="noaux_tc", rope_theta=10000.0, max_position_embeddings=163840, rms_norm_eps=1e-6,
               tie_word_embeddings=False)
"""A DeepSeek-V3-style MoE (MLA, 64 routed experts top-6 + 2 shared, sigmoid routing), ~4.2B parameters."""
LLAMA_1B = dict(model_type="llama", vocab_size=32768, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
"""#11's ~1B dense model: a Llama-3.2-1B body (hidden 2048, 16 layers, GQA 16/8) with a 32k vocabulary, 1.14B
parameters (bench/fp8_train_step.py's DENSE_1B)."""
SMOKE_DENSE = dict(LLAMA_1B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MODELS = {"dsv3-4b": DSV3_4B, "llama-1b": LLAMA_1B}
SMOKE = dict(DSV3_4B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             moe_intermediate_size=32)


def model_flops_per_token(hf: dict, seq: int) -> tuple[float, int, int]:
    """(training FLOPs per token, total parameters, parameters a token's matmuls use)."""
    import torch

    from rlcli.models import ModelArgs, build_model

    with torch.device("meta"):
        model = build_model(ModelArgs.from_hf(hf), materialize=False)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = sum(p.numel() for n, p in model.named_parameters() if n.endswith("embed_tokens.weight"))
    routed = hf["num_experts_per_tok"] / hf["n_routed_experts"] if expert else 1.0
    active = total - embed - expert + expert * routed
    if "qk_nope_head_dim" in hf:  # MLA
        qk, v = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["v_head_dim"]
    else:
        qk = v = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    attn = 6 * hf["num_hidden_layers"] * hf["num_attention_heads"] * (qk + v) * seq / 2
    return 6 * active + attn, total, int(active)


ARMS = ("bf16", "fp8", "fp8-gate-up", "fp8-fused", "fp8-torch", "fp8-torch-fused", "bf16-invariant", "fp8-invariant",
        "bf16-step", "fp8-step")


def write_run(root: Path, hf: dict, seq: int, prompt: int, rows: int, steps: int, world: int, ep: int, cp: int,
              profile_step: int, threads: int, attention: str = "auto", dtype: str = "bfloat16",
              ac: str = "full", compile_blocks: bool = False, siblings: tuple[str, ...] = ("qkv",),
              graph: str = "eager", backend: str = "auto", invariant: bool = False,
              reshard: str = "micro_batch") -> Path:
    """Model dir, recipe and the --steps batches of one arm; returns the recipe's path. ``dtype`` is
    model.dtype, the compute dtype (FSDP2 keeps fp32 masters either way): its default in a recipe is
    float32, in which the sixth session's H200 "bf16" arm ran, slowly (FlexAttention's fp32 kernels)."""
    import torch

    from rlcli.config import dump_toml
    from rlcli.envs import Task
    from rlcli.orchestrate.rollouts import Group, write_batch
    from rlcli.protocol import Completion
    from rlcli.parallel.context import rank_tokens
    from rlcli.transport.rundir import RunDir

    model_dir, run_dir = root / "model", root / "run"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(hf))
    dp = world // cp
    tree = {
        "name": "trainer-node", "seed": 0, "num_steps": steps, "run_dir": str(run_dir),
        "model": {"path": str(model_dir), "max_seq_len": seq, "dtype": dtype, "batch_invariant": invariant},
        "train": {"micro_batch_tokens": seq, "activation_checkpointing": ac, "compile": compile_blocks,
                  "profile_step": profile_step, "attention": attention,
                  "num_threads": threads, "threads": "fixed",
                  "optim": {"lr": 1e-5}, "loss": {"kind": "tis"}, "checkpoint": {"interval": 10**6},
                  "parallel": {"ep": ep, "cp": cp, "reshard": reshard},
                  # every micro-batch is one row: DeepGEMM's kernels for that size alone (rlcli.ops.fp8.warmup)
                  "fp8": {"jit_warmup_tokens": [rank_tokens(seq, cp)], "fuse_siblings": list(siblings),
                          "graph": graph, "backend": backend}},
        "orchestrate": {"num_train_ranks": dp, "batch_size": rows * dp, "group_size": 1},
        "sync": {"backend": {"kind": "collective"}},
    }
    recipe = root / "recipe.toml"
    recipe.write_text(dump_toml(tree))
    run = RunDir(run_dir)
    V, n = hf["vocab_size"], seq - prompt
    gen = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        groups = []
        for r in range(rows * dp):
            ids = torch.randint(0, V, (seq,), generator=gen).tolist()
            g = Group(Task(f"s{step}r{r}"), ids[:prompt], step - 1)
            g.completions = [Completion(token_ids=ids[prompt:], logprobs=[-math.log(V)] * n, versions=[step - 1] * n,
                                        finish_reason="length")]
            g.rewards, g.advantages = [0.0], [1.0 if r % 2 else -1.0]
            groups.append(g)
        write_batch(run, step, groups, dp, seq, 1.0)
    return recipe


def run_arm(recipe: Path, world: int, fp8: bool, timeout_s: int, cpu: bool = False) -> tuple[list[dict], str]:
    """The trainer's per-step metrics, and what went wrong (empty: nothing). A run past
    ``timeout_s`` is killed (its process group) and the steps it finished are kept. ``cpu``:
    the ranks see no GPU (gloo), also on a GPU host."""
    cmd = [sys.executable, "-m", "rlcli.cli.train", "run", "--config", str(recipe), "--nproc-per-node", str(world)]
    if fp8:
        cmd.append("--fp8")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "NCCL_NVLS_ENABLE": "0", **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    log = recipe.parent / "rl-train.log"
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            from rlcli.process import children

            ranks = children(proc.pid)  # torchrun's ranks: each in a session of its own
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
            # They die with torchrun (rlcli.process.die_with_parent); the next arm must not
            # start while one still holds the GPU.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(Path(f"/proc/{r}").exists() for r in ranks):
                time.sleep(0.2)
    metrics = recipe.parent / "run" / "metrics" / "train.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if rc == 0:
        return rows, ""
    errors = [line for line in log.read_text(errors="replace").splitlines() if "Error" in line or "error:" in line]
    why = f"timed out after {timeout_s} s" if rc is None else f"failed (rc {rc}) after {time.monotonic() - t0:.0f} s"
    return rows, f"{why}, {len(rows)} steps done; log {log}" + "".join(f"\n  {e[:400]}" for e in errors[:3])


def summarize(rows: list[dict], tokens_per_step: int, flops_per_token: float, peak_tflops: float,
              world: int, profile_step: int) -> dict:
    # Steps 1-2 compile (FlexAttention goes dynamic at the second shape); the profiled step is slower.
    timed = [r["compute_s"] for r in rows[2:] if r["step"] != profile_step] or [r["compute_s"] for r in rows]
    step_s = statistics.median(timed)
    tok_s = tokens_per_step / step_s
    prof = next((r for r in rows if r["step"] == profile_step), {})
    out = {"step_s": step_s, "tokens_s": tok_s, "mfu": tok_s * flops_per_token / (world * peak_tflops * 1e12),
           "peak_gib": max((r.get("peak_mem_gib", float("nan")) for r in rows), default=float("nan")),
           "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}
    for kind in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce"):
        # Over the unprofiled step time: the profiler slows the host, not the kernels it times.
        out[kind] = prof.get(f"comm_{kind}_s", float("nan")) / step_s
    return out


def top_events(trace: Path, device: bool, n: int = 12) -> list[tuple[str, float, int]]:
    """(name, seconds, calls) of the ``n`` names with the most time in a Chrome trace: device kernels
    (and GPU memcpy/memset), or, with ``device`` False, host ops (nested ones count again inside their callers)."""
    total: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in json.loads(trace.read_text()).get("traceEvents", []):
        if e.get("ph") != "X" or (e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")) != device:
            continue
        if not device and e.get("cat") not in ("cpu_op", "user_annotation"):
            continue
        total[e["name"]] = total.get(e["name"], 0.0) + e.get("dur", 0) / 1e6
        calls[e["name"]] = calls.get(e["name"], 0) + 1
    return [(k, total[k], calls[k]) for k in sorted(total, key=total.get, reverse=True)[:n]]


def kernel_classes(trace: Path) -> dict[str, float]:
    """Device seconds by kernel class (bench/fp8_train_step.py's classes: FP8 and bf16 GEMMs,
    quantization, attention, optimizer, elementwise/other) in a Chrome trace."""
    from fp8_train_step import classify

    out: dict[str, float] = {}
    for e in json.loads(trace.read_text()).get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            c = classify(e["name"])
            out[c] = out.get(c, 0.0) + e.get("dur", 0) / 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="GPUs (ranks) for rl-train")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (the context length; default 32768, "
                    "--smoke 256)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens of each row (no loss; default seq / 8)")
    ap.add_argument("--rows", type=int, default=1, help="rows per data-parallel rank per step")
    ap.add_argument("--steps", type=int, default=6, help="RL steps; 1-2 and the profiled one are not timed")
    ap.add_argument("--profile-step", type=int, default=0, help="the step run under torch.profiler (0: the last)")
    ap.add_argument("--model", default="dsv3-4b", choices=sorted(MODELS),
                    help="dsv3-4b: the DeepSeek-V3-style MoE (#16); llama-1b: #11's ~1B dense Llama")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's own)")
    ap.add_argument("--ac", default="full", choices=["none", "full", "selective"],
                    help="train.activation_checkpointing of both arms")
    ap.add_argument("--compile", action="store_true", help="train.compile (rl-train --compile) in both arms")
    ap.add_argument("--top", type=int, default=12, help="kernels listed from the profiled step")
    ap.add_argument("--arms", default="bf16,fp8",
                    help="comma list of " + ", ".join(ARMS) + ": bf16; fp8, rl-train's default (q/k/v stacked; "
                         "under --compile the FP8 linears run between graph pieces); fp8-gate-up (gate/up stacked "
                         "too, train.fp8.fuse_siblings); fp8-fused (train.fp8.graph = fused: under --compile the "
                         "linears in the graph); fp8-torch and fp8-torch-fused (the same two with train.fp8.backend = torch); "
                         "bf16-invariant and fp8-invariant (model.batch_invariant, the engine's logprob bits; not "
                         "with --compile); bf16-step and fp8-step (train.parallel.reshard = step: FSDP2 casts the "
                         "masters and reduces gradients once per step, not per row)")
    ap.add_argument("--attention", default="auto", help="train.attention (auto: flex under --cp, cudnn without)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="model.dtype, the compute dtype of both arms (default bfloat16; --smoke: float32)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU, dense bf16 (H200 SXM: 989)")
    ap.add_argument("--timeout", type=int, default=540, help="seconds per arm")
    ap.add_argument("--smoke", action="store_true", help="tiny model, CPU (gloo), 256-token rows")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here (checkpoints are deleted)")
    a = ap.parse_args()
    dense = a.model == "llama-1b"
    if dense and a.ep != 1:
        ap.error("--model llama-1b is dense: give --ep 1")
    unknown = [arm for arm in a.arms.split(",") if arm not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown arm {unknown[0]!r}; choose from {', '.join(ARMS)}")
    if a.compile and "-invariant" in a.arms:
        ap.error("--arms: model.batch_invariant refuses train.compile; run the -invariant arms without --compile")
    hf = dict((SMOKE_DENSE if dense else SMOKE) if a.smoke else MODELS[a.model])
    if a.layers:
        hf["num_hidden_layers"] = a.layers
    if a.smoke:
        a.steps = max(3, min(a.steps, 4))
    a.seq = a.seq or (256 if a.smoke else 32768)
    a.prompt = a.seq // 8 if a.prompt is None else a.prompt
    a.profile_step = a.profile_step or a.steps
    a.dtype = a.dtype or ("float32" if a.smoke else "bfloat16")
    flops, total, active = model_flops_per_token(hf, a.seq)
    dp = a.nproc // a.cp
    tokens_per_step = a.rows * dp * a.seq
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not a.smoke else "cpu (gloo)"
    what = ("dense Llama" if dense else f"DeepSeek-V3-style MoE ({hf['n_routed_experts']} experts "
                                         f"top-{hf['num_experts_per_tok']})")
    print(f"# rl-train on {a.nproc} ranks ({device}), --ep {a.ep} --cp {a.cp} (dp {dp}); {what} "
          f"{total / 1e9:.2f}B parameters ({active / 1e9:.2f}B in a token's matmuls), {hf['num_hidden_layers']} "
          f"layers; rows of {a.seq} tokens ({a.prompt} prompt), {tokens_per_step} tokens per step, {a.steps} steps, "
          f"activation checkpointing {a.ac}{', compiled blocks' if a.compile else ''}, compute in {a.dtype} "
          f"(model.dtype), torch {torch.__version__}", flush=True)
    results = {}
    base = a.keep or Path(tempfile.mkdtemp(prefix="trainer-node-"))
    for arm in a.arms.split(","):
        root = base / arm
        recipe = write_run(root, hf, a.seq, a.prompt, a.rows, a.steps, a.nproc, a.ep, a.cp, a.profile_step,
                           1 if a.smoke else 0, a.attention, a.dtype, a.ac, a.compile,
                           ("qkv", "gate_up") if arm == "fp8-gate-up" else ("qkv",),
                           "fused" if arm.endswith("-fused") else "eager",
                           "torch" if arm.startswith("fp8-torch") else "auto", arm.endswith("-invariant"),
                           "step" if arm.endswith("-step") else "micro_batch")
        t0 = time.monotonic()
        rows, err = run_arm(recipe, a.nproc, arm.startswith("fp8"), a.timeout, cpu=a.smoke)
        # rl-train's last checkpoint is the whole trainer state (~52 GB at 4.3B): one arm's at a time, --keep or
        # not (a kept bf16 arm's filled the GPU machine's 64 GiB disk under the FP8 arm, eleventh session)
        shutil.rmtree(root / "run" / "checkpoints", ignore_errors=True)
        print(f"{arm}: compute s per step " + " ".join(f"{r['compute_s']:.2f}" for r in rows), flush=True)
        print(f"{arm}: graphs compiled / frames run eagerly per step " + " ".join(
            f"{r.get('compile_graphs', float('nan')):.0f}/{r.get('compile_fallbacks', float('nan')):.0f}" for r in rows),
            flush=True)
        trace = root / "run" / "profiles" / f"train-step{a.profile_step}-rank0.json"
        if trace.exists():
            print(f"{arm}: step {a.profile_step}, rank 0, largest {'host ops' if a.smoke else 'device kernels'} "
                  "(s, calls):\n" + "\n".join(f"  {t:8.3f} {n:6d}  {name[:100]}"
                                                 for name, t, n in top_events(trace, not a.smoke, a.top)), flush=True)
            if not a.smoke:
                classes = kernel_classes(trace)
                print(f"{arm}: step {a.profile_step}, device s by kernel class: " + ", ".join(
                    f"{c} {t:.3f}" for c, t in sorted(classes.items(), key=lambda kv: -kv[1]))
                    + f"; sum {sum(classes.values()):.3f}", flush=True)
        if err:
            print(f"{arm}: {err}", flush=True)
            if len(rows) < 3:
                continue
        results[arm] = summarize(rows, tokens_per_step, flops, a.peak_tflops, a.nproc, a.profile_step)
        print(f"{arm}: {json.dumps(results[arm])} ({time.monotonic() - t0:.0f} s)", flush=True)
    w = max([11, *map(len, results)])
    print(f"{'arm':<{w}} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'a2a':>6} {'gather':>7} "
          f"{'scatter':>8} {'loss first/last':>16}")
    for arm, r in results.items():
        print(f"{arm:<{w}} {r['step_s']:>8.3f} {r['tokens_s']:>10.0f} {r['mfu']:>6.1%} {r['peak_gib']:>9.1f} "
              f"{r['all_to_all']:>6.1%} {r['all_gather']:>7.1%} {r['reduce_scatter']:>8.1%} "
              f"{r['loss_first']:>+8.4f}/{r['loss_last']:+.4f}")
    failed = [arm for arm in a.arms.split(",") if arm not in results]
    for arm in results:
        twin = arm.removesuffix("-invariant")  # what the flag costs: against the same arm without it
        for base in dict.fromkeys(b for b in ("bf16", twin) if b != arm and b in results):
            print(f"{arm} / {base} tokens/s: {results[arm]['tokens_s'] / results[base]['tokens_s']:.2f}x")
    if failed:
        sys.exit(f"arms without a result: {', '.join(failed)} (their errors are above)")


if __name__ == "__main__":
    main()
