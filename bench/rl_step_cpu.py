"""CPU-seconds of one shared-prompt RL step's two halves, code A against code B, side by side.

The workload of issue #15's scaled SmolLM2-135M recipe (fp32, one thread): the engine
generates 4 prompts x 8 completions of 24 tokens (``NativeEngine``, EOS ignored, so every
run does the same work), and the trainer runs forward + backward over those samples packed
as one shared-prompt row (completions cut to 6-24 tokens, ``rlcli.train.step.accumulate``
with the recipe's kept logits). Each part is timed in ``time.process_time`` of a fresh
worker process, which outside load inflates less than wall time.

Each ``--refs`` entry is a git ref (unpacked with ``git archive``) or ``.`` (this tree); the
workers of the refs alternate, ``--reps`` rounds, and the median per ref and part is
printed with the ratio to the first ref. Prompts are random ids shaped like the recipe's
chat prompts: 55 tokens, of which the first 29 (system message and instruction) are the same
in all four, so the workload needs no tokenizer or environment. A worker calls
``keep_freed_memory`` where its tree has it, as rl-train and rl-infer do on a CPU.

    python bench/rl_step_cpu.py --refs main . --reps 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(part: str, model_dir: str) -> dict:
    """Run one part in this process (the rlcli on sys.path) and return its CPU-seconds."""
    import numpy as np
    import torch

    from rlcli.infer.engine import NativeEngine
    from rlcli.models import load_model
    from rlcli.protocol import GenerateRequest, SamplingParams

    torch.set_num_threads(1)
    try:  # as rl-train and rl-infer do on a CPU, where this tree has it
        from rlcli.transport.host_memory import keep_freed_memory

        keep_freed_memory()
    except ImportError:
        pass
    rng = np.random.default_rng(0)
    head = rng.integers(100, 40000, 29).tolist()  # the chat template's system message and instruction
    prompts = [head + rng.integers(100, 40000, 26).tolist() for _ in range(4)]
    model = load_model(Path(model_dir), device=torch.device("cpu"), dtype=torch.float32, seed=0)
    engine = NativeEngine(model, eos_token_ids=[2], max_model_len=128, kv_cache_memory_mb=192, max_num_seqs=32)

    def generate(tag: str) -> list:
        for i, p in enumerate(prompts):
            engine.add_request(GenerateRequest(request_id=f"{tag}-{i}", prompt_ids=p, cache_salt=tag,
                                               sampling=SamplingParams(n=8, max_tokens=24, ignore_eos=True)))
        done = []
        while engine.has_work():
            done += [o for o in engine.step() if hasattr(o, "completions")]
        return sorted(done, key=lambda o: o.request_id)

    out = generate("warm")
    if part == "engine":
        t0 = time.process_time()
        generate("timed")
        return {"engine_s": time.process_time() - t0}
    from rlcli.config.train import LossConfig
    from rlcli.protocol.batch import Sample, build_micro_batch
    from rlcli.train.loss import LOSSES
    from rlcli.train.step import accumulate

    samples = []
    for o, p in zip(out, prompts):
        for c in o.completions:
            n = int(rng.integers(6, 25))
            samples.append(Sample(token_ids=p + c.token_ids[:n], num_prompt_tokens=len(p),
                                  advantage=float(rng.standard_normal()), logprobs=c.logprobs[:n],
                                  versions=c.versions[:n]))
    mb = build_micro_batch(samples, 1.0, 1.0, share_prompts=True)
    lcfg = LossConfig()
    model.train()

    class NoParallel:
        enabled, cp = False, 1

    def step() -> None:
        accumulate(model, [mb], NoParallel(), torch.device("cpu"), LOSSES[lcfg.kind], lcfg, 4096, keep_logits=True)
        model.zero_grad(set_to_none=True)

    step()
    t0 = time.process_time()
    step()
    return {"train_s": time.process_time() - t0, "row_tokens": int(mb.input_ids.numpy().size)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--refs", nargs="+", default=["main", "."], help="git refs, or . for this tree")
    p.add_argument("--parts", nargs="+", default=["engine", "train"], choices=["engine", "train"])
    p.add_argument("--reps", type=int, default=3, help="rounds (each runs every ref's workers once)")
    p.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    p.add_argument("--work", type=Path, default=Path("/tmp/rlcli-rl-step-cpu"), help="unpacked refs go here")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.model)))
        return
    sys.path.insert(0, str(REPO / "bench"))
    from trainer_throughput import smollm2_dir, source_tree

    smollm2_dir(Path(a.model))
    trees = {ref: REPO if ref == "." else source_tree(ref, a.work / ref.replace("/", "_")) for ref in a.refs}
    times: dict[tuple[str, str], list[float]] = {}
    for rep in range(a.reps):
        for part in a.parts:
            for ref, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": str(tree)}
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", part, "--model",
                                      a.model], capture_output=True, text=True, env=env, cwd=tree)
                if out.returncode != 0:
                    raise SystemExit(f"{ref} {part} failed:\n{out.stderr[-3000:]}")
                r = json.loads(out.stdout.splitlines()[-1])
                times.setdefault((ref, part), []).append(r[f"{part}_s"])
                print(json.dumps({"rep": rep, "ref": ref, "part": part, **r}), flush=True)
    print(f"\n{'part':<8} {'ref':<12} {'CPU-s median':>12} {'all':>28} {'vs ' + a.refs[0]:>9}")
    for part in a.parts:
        base = statistics.median(times[(a.refs[0], part)])
        for ref in a.refs:
            xs = times[(ref, part)]
            med = statistics.median(xs)
            print(f"{part:<8} {ref:<12} {med:>12.3f} {' '.join(f'{x:.2f}' for x in xs):>28} {base / med:>8.3f}x")


if __name__ == "__main__":
    main()
