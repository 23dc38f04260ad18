"""The native engine's step time by concurrency on a device: the working tree against a baseline tree.

The workload is #9's long-tail recipe's model (recipes/models/micro-llama, random weights): for each
concurrency C, C/4 prompts of 16 tokens (``--prompt-tokens``), n = 4 completions each (C sequences), 64
new tokens, EOS ignored, sampled at temperature 1. After two warm-up steps and the prompts' prefill,
milliseconds per engine step over the rest. At this size a step's cost is the host's (scheduling,
bookkeeping, kernel launches and host-to-device copies), which is what bounds asynchronous RL's step on a GPU (docs/benchmarks.md,
twenty-fourth session). Each arm runs in its own process with its own tree first on ``PYTHONPATH``,
the arms alternating ``--repeats`` times; the best time per concurrency counts.

    python bench/engine_decode.py --device cuda --baseline HEAD          # a git ref, checked out here
    python bench/engine_decode.py --device cuda --baseline-tree /tmp/base  # an unpacked tree (no .git on the machine)
    python bench/engine_decode.py --smoke                                 # CPU, the working tree as both arms
    python bench/engine_decode.py --device cuda --paged-decode --baseline-tree .  # the paged decode kernel against the eager path
    python bench/engine_decode.py --device cuda --dtype bfloat16 --cuda-graphs --baseline-tree . --model qwen3-0.6b
                                                                          # decode steps as CUDA graphs against eager ones
    python bench/engine_decode.py --device cuda --dtype bfloat16 --fused-kernels --baseline-tree . --model qwen3-0.6b
                                                                          # graphed steps with the fused kernels against without
    python bench/engine_decode.py --device cuda --dtype bfloat16 --cuda-graphs --fp8 --baseline-tree . --model qwen3-0.6b
                                                                          # FP8 weights (rl-infer --fp8): graphed against eager
    python bench/engine_decode.py --device cuda --dtype bfloat16 --fp8 tree --baseline-tree . --model qwen3-0.6b
                                                                          # eager steps: FP8 weights against bf16 ones
    python bench/engine_decode.py --device cuda --dtype bfloat16 --fp8 tree --cuda-graphs --baseline-tree . --model qwen3-0.6b
                                                                          # the same, both arms graphed

``--model qwen3-0.6b`` takes Qwen3-0.6B's shapes (recipes/models/qwen3-0.6b-config, random weights) instead,
``--model tiny-qwen3-moe`` the MoE recipe's model (8 experts, top-2; graphs need bf16 for its grouped GEMMs),
``--model dsv3-1.7b`` DeepSeek-V3's attention and routing at 1.7B (recipes/models/dsv3-1.7b-random: MLA, 32 experts),
``--model dsv32-1.7b`` the same with DeepSeek-V3.2's sparse attention (a 64-head indexer choosing 2,048 tokens).
Besides ms per step, each arm reports its engine's construction time (warm-up and graph capture).
``--host-only`` replaces the model's forward with fixed logits in both arms: what is left of a step is the
engine's host work (scheduling, building the inputs, sampling, bookkeeping), which a graphed step of a
small model is mostly made of; it measures that on any machine (on CUDA both arms replay graphs of
the fixed forward, as a graphed engine's step would).

    python bench/engine_decode.py --host-only --baseline HEAD~1 --concurrency 64,256,512
    python bench/engine_decode.py --host-only --r3 --model tiny-qwen3-moe --tokens 2048   # with R3's routes kept
    python bench/engine_decode.py --device cuda --dtype bfloat16 --baseline HEAD~1 --model dsv32-1.7b \
        --prompt-tokens 3000 --max-model-len 4096 --kv-cache-mb 8192 --concurrency 16,64   # DSA at long contexts
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _baseline import baseline_tree

REPO = Path(__file__).resolve().parents[1]

WORKLOAD = """
import inspect, json, sys, time
import torch
from rlcli.infer.engine import NativeEngine
from rlcli.models import load_model
from rlcli.protocol import GenerateRequest, SamplingParams

device, dtype, tokens, model_dir = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), sys.argv[4]
concurrencies = [int(c) for c in sys.argv[5].split(",")]
max_model_len = int(sys.argv[8])
# paged_decode (on by default since 2026-12-06) and cuda_graphs set either way where the tree's engine
# has the keyword
params = inspect.signature(NativeEngine).parameters
extra = {k: v == "1" for k, v in (("paged_decode", sys.argv[6]), ("cuda_graphs", sys.argv[7]),
                                   ("fused_kernels", sys.argv[11])) if k in params}
torch.set_num_threads(1)
if sys.argv[12] == "1":  # --fp8: FP8 weights and block scales in the linears, as rl-infer --fp8 loads them
    from rlcli.config.model import Fp8Config
    model = load_model(model_dir, device=device, dtype=dtype, seed=0, fp8=Fp8Config(enabled=True),
                       fp8_storage=True).eval()
else:
    model = load_model(model_dir, seed=0).eval().to(device, dtype)
r3 = sys.argv[10] == "1"
prompt = int(sys.argv[13])
if sys.argv[9] == "1":  # --host-only: the forward's output fixed, so a step is the engine's own host work
    fixed = torch.randn(max(concurrencies), model.args.vocab_size, device=device, dtype=dtype)
    a = model.args
    experts = torch.randint(0, max(a.num_experts, 1), (4096, a.num_moe_layers, a.num_experts_per_tok or 1),
                            device=device)

    def hidden_states(ids, pos, ctx):
        if ctx.routing is not None and ctx.routing.record:  # an MoE's routes, as its layers record them
            ctx.routing.recorded.extend(experts[:ids.shape[1], i] for i in range(a.num_moe_layers))
        return fixed.new_zeros(1, ids.shape[1], 1)

    model.hidden_states = hidden_states

    class FixedLogits(torch.nn.Module):
        def forward(self, h):
            return fixed[:h.shape[0]]

    model.lm_head = FixedLogits()
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
out = {}
for c in concurrencies:
    sync()
    t = time.perf_counter()
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=max_model_len, max_num_seqs=max(c, 4),
                          kv_cache_memory_mb=int(sys.argv[14]) if device.startswith("cuda") else 256, **extra)
    sync()
    build = time.perf_counter() - t
    for i in range(max(1, c // 4)):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=[256] + [(i * 7 + j) % 250 for j in range(prompt - 1)],
                                           sampling=SamplingParams(temperature=1.0, max_tokens=tokens, n=min(c, 4),
                                                                   ignore_eos=True, return_routing=r3)))
    engine.step(); engine.step()
    while engine.waiting or any(s.num_computed < len(s.req.prompt_ids) for s in engine.running):
        engine.step()  # long prompts: prefill done before the timed decode steps
    sync()
    t, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    out[c] = ((time.perf_counter() - t) / max(steps, 1) * 1e3, build)
    engine.close()
print(json.dumps(out))
"""


MODELS = {"micro-llama": REPO / "recipes" / "models" / "micro-llama",
          "qwen3-0.6b": REPO / "recipes" / "models" / "qwen3-0.6b-config",
          "tiny-qwen3-moe": REPO / "recipes" / "models" / "tiny-qwen3-moe",
          "dsv3-1.7b": REPO / "recipes" / "models" / "dsv3-1.7b-random",
          "dsv32-1.7b": None}  # dsv3-1.7b with DeepSeek-V3.2's indexer, written at run time (model_dir)
# DeepSeek-V3.2's lightning indexer (its config's values) on dsv3-1.7b-random's layout.
DSV32 = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "index_topk": 2048,
         "index_n_heads": 64, "index_head_dim": 128}


def model_dir(name: str, tmp: Path) -> Path:
    """The model's directory; ``dsv32-1.7b``'s is written under ``tmp`` (a config.json only: random weights)."""
    if MODELS[name] is not None:
        return MODELS[name]
    base = MODELS["dsv3-1.7b"]
    out = tmp / name
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps({**json.loads((base / "config.json").read_text()), **DSV32}))
    (out / "tokenizer_config.json").write_text((base / "tokenizer_config.json").read_text())
    return out


def run(tree: Path, args, paged: bool = False, graphs: bool = False, fused: bool = True,
        fp8: bool = False) -> dict[int, tuple[float, float]]:
    # The tree first; then the caller's path, where packages carried to a machine may be (/tmp/site).
    env = {"PYTHONPATH": os.pathsep.join([str(tree), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]),
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", WORKLOAD, args.device, args.dtype, str(args.tokens),
                          str(args.model_dir), args.concurrency, "1" if paged else "0", "1" if graphs else "0",
                          str(args.max_model_len), "1" if args.host_only else "0", "1" if args.r3 else "0",
                          "1" if fused else "0", "1" if fp8 else "0", str(args.prompt_tokens), str(args.kv_cache_mb)],
                         env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return {int(k): tuple(v) for k, v in json.loads(out.stdout.splitlines()[-1]).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="HEAD", help="git ref of the baseline arm [HEAD]")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="an unpacked tree as the baseline instead (e.g. `git archive REF | tar -x -C DIR`)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", default="1,16,64,192,512", help="comma-separated sequence counts")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (each prompt is sampled n = 4 times)")
    p.add_argument("--kv-cache-mb", type=int, default=1024, help="the engine's KV cache on CUDA (MiB)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--paged-decode", action="store_true",
                   help="the tree's arm decodes through the paged decode kernel (infer.engine.paged_decode); "
                        "without it both arms gather (paged_decode off where the tree has it), so with "
                        "--baseline-tree . the baseline is the same code without the kernel")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="the tree's arm replays decode steps as CUDA graphs (infer.engine.cuda_graphs) and both "
                        "arms decode through the paged kernel; without it both arms run eagerly. With --fp8 tree "
                        "both arms replay graphs: FP8 against the baseline's --dtype, both graphed")
    p.add_argument("--fused-kernels", action="store_true",
                   help="both arms decode through the paged kernel and replay CUDA graphs (the defaults); the tree's "
                        "arm runs the fused kernels (infer.engine.fused_kernels), the baseline's not. Without it "
                        "both arms run them (where their tree has them)")
    p.add_argument("--fp8", nargs="?", const="both", choices=("both", "tree"), default=None,
                   help="FP8 weights and block scales in the linears (rl-infer --fp8; GEMM backend auto) in both "
                        "arms, or in the tree's only (against the baseline's weights in --dtype)")
    p.add_argument("--model", choices=sorted(MODELS), default="micro-llama")
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--host-only", action="store_true",
                   help="both arms with the model's forward replaced by fixed logits: the engine's host work "
                        "alone (scheduling, input building, sampling, bookkeeping)")
    p.add_argument("--r3", action="store_true", help="requests ask for their routes (return_routing; an MoE model)")
    p.add_argument("--smoke", action="store_true", help="CPU, 1 and 8 sequences, 8 tokens, the working tree as both arms")
    args = p.parse_args()
    if args.smoke:
        args.device, args.concurrency, args.tokens, args.repeats = "cpu", "1,8", 8, 1
    with baseline_tree(args.baseline, args.baseline_tree, same=args.smoke) as (base, label), \
            tempfile.TemporaryDirectory() as tmp:
        args.model_dir = model_dir(args.model, Path(tmp))
        best: dict[str, dict[int, float]] = {"baseline": {}, "tree": {}}
        build: dict[str, dict[int, float]] = {"baseline": {}, "tree": {}}
        for _ in range(args.repeats):
            for arm, tree in (("baseline", base), ("tree", REPO)):
                paged = (args.cuda_graphs or args.host_only or args.fused_kernels
                         or (args.paged_decode and arm == "tree"))
                graphs = args.host_only or args.fused_kernels or (args.cuda_graphs and (arm == "tree" or
                                                                                        args.fp8 == "tree"))
                fused = not args.fused_kernels or arm == "tree"
                fp8 = args.fp8 == "both" or (args.fp8 == "tree" and arm == "tree")
                for c, (ms, secs) in run(tree, args, paged, graphs, fused, fp8).items():
                    best[arm][c] = min(best[arm].get(c, float("inf")), ms)
                    build[arm][c] = min(build[arm].get(c, float("inf")), secs)
    print(f"# native engine ({args.model}), ms per step, {args.device} {args.dtype}, {args.tokens} new tokens; "
          f"baseline: {label}" + ("; tree with paged_decode" if args.paged_decode else "")
          + (("; both arms cuda_graphs" if args.fp8 == "tree" else "; tree with cuda_graphs, both arms paged_decode")
             if args.cuda_graphs else "")
          + ("; tree with fused_kernels, both arms cuda_graphs" if args.fused_kernels else "")
          + ({"both": "; FP8 weights in both arms", "tree": "; FP8 weights in the tree's arm"}.get(args.fp8, ""))
          + ("; host work only (fixed logits)" if args.host_only else "") + ("; routes returned (R3)" if args.r3 else ""))
    print(f"{'sequences':>9} {'baseline':>9} {'tree':>9} {'ratio':>7} {'build s (baseline, tree)':>26}")
    for c in sorted(best["tree"]):
        b, t = best["baseline"][c], best["tree"][c]
        print(f"{c:>9} {b:>9.2f} {t:>9.2f} {b / t:>6.2f}x {build['baseline'][c]:>12.2f} {build['tree'][c]:>12.2f}")


if __name__ == "__main__":
    main()
