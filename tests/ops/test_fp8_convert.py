"""convert_to_fp8 on whole models: which modules swap, what stays, gradients, MoE experts, and
the engine/trainer pair computing the same function under FP8."""

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from rlcli.infer.engine import NativeEngine
from rlcli.models import ModelArgs, build_model, load_model, save_model
from rlcli.ops.fp8.convert import FP8GroupedExperts, convert_to_fp8
from rlcli.ops.fp8.linear import FP8Linear, fp8_linear
from rlcli.protocol import GenerateRequest, SamplingParams
from rlcli.train.loss import token_logprobs

REPO = Path(__file__).resolve().parents[2]
CFG = SimpleNamespace(enabled=True, backend="emulated", include=["*"],
                      exclude=["*embed_tokens", "lm_head", "*.mlp.gate"], ue8m0=False)
MOE = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 160, "intermediate_size": 96,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 40,
       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 136, "norm_topk_prob": True,
       "mlp_only_layers": [1]}
DSA = {"model_type": "deepseek_v32", "vocab_size": 97, "hidden_size": 128, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "moe_intermediate_size": 128,
       "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
       "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
       "index_topk": 24, "index_n_heads": 4, "index_head_dim": 32}


def test_convert_swaps_linears_but_not_head_embeddings_or_router():
    model = load_model(REPO / "recipes/models/tiny-llama", seed=0)
    keys = {k: v.shape for k, v in model.state_dict().items()}
    names = convert_to_fp8(model, CFG)
    assert len(names) == 4 * 7 and "lm_head" not in names
    assert isinstance(model.get_submodule("model.layers.0.mlp.down_proj"), FP8Linear)
    assert type(model.lm_head) is torch.nn.Linear
    assert {k: v.shape for k, v in model.state_dict().items()} == keys  # checkpoints and optimizers see no change
    only_mlp = SimpleNamespace(**{**vars(CFG), "include": ["*.mlp.*"]})
    assert all(".mlp." in n for n in convert_to_fp8(load_model(REPO / "recipes/models/tiny-llama"), only_mlp))


def test_default_fp8_config_keeps_the_dsa_indexer_head_weights_in_high_precision():
    """As in DeepSeek-V3.2's checkpoints: the indexer's wq_b and wk are FP8, its weights_proj is not."""
    from rlcli.config.model import Fp8Config

    model = build_model(ModelArgs.from_hf(DSA))
    names = set(convert_to_fp8(model, Fp8Config(enabled=True, backend="emulated")))
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.self_attn.indexer"
        assert {f"{prefix}.wq_b", f"{prefix}.wk"} <= names and f"{prefix}.weights_proj" not in names
        assert type(model.get_submodule(f"{prefix}.weights_proj")) is torch.nn.Linear


def test_fp8_moe_experts_equal_per_expert_fp8_linears_and_get_gradients():
    args = ModelArgs.from_hf(MOE)
    model = build_model(args)
    model.init_weights(seed=0, std=0.1)
    names = convert_to_fp8(model, CFG)
    assert "model.layers.0.mlp.experts" in names and "model.layers.0.mlp.gate" not in names
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(experts, FP8GroupedExperts)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 160, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(30)])
    idx[:, 0] = torch.where(idx[:, 0] == 3, 0, idx[:, 0])  # leaves expert 3 with fewer tokens
    gates = torch.rand(30, 2, generator=g)
    out = model.get_submodule("model.layers.0.mlp").routed(x, idx, gates)  # sorts by expert, runs the experts
    ref = torch.zeros_like(x)
    be = experts.backend
    for e in range(4):
        rows, slot = (idx == e).nonzero(as_tuple=True)
        if len(rows):
            h = F.silu(fp8_linear(x[rows], experts.w_gate[e], None, be)) * fp8_linear(x[rows], experts.w_up[e], None, be)
            ref.index_add_(0, rows, fp8_linear(h, experts.w_down[e], None, be) * gates[rows, slot, None])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.pow(2).sum().backward()
    for w in (experts.w_gate, experts.w_up, experts.w_down):
        assert w.grad is not None and w.grad.abs().sum() > 0


def test_engine_and_trainer_compute_the_same_function_in_fp8(tmp_path):
    """rl-infer holds FP8 weights + scales, rl-train quantizes its master weights on the fly: the
    same forward is bitwise equal. Sampled through the engine (paged attention, whose fp32
    rounding differs from the trainer's packed attention by ~1e-7), the logprobs still differ a
    little: FP8 rounding turns a near-tie into a one-ulp flip. Bench: bench/fp8_mismatch.py."""
    model = load_model(REPO / "recipes/models/tiny-llama", seed=0)
    model.init_weights(seed=0, std=0.1)
    save_model(model, tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        engine_model = load_model(tmp_path, dtype=dtype, fp8=CFG, fp8_storage=True)
        trainer_model = load_model(tmp_path, dtype=dtype, fp8=CFG).eval()
        assert engine_model.get_submodule("model.layers.1.self_attn.o_proj").weight.dtype == torch.float8_e4m3fn
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 100, 101]])
        with torch.no_grad():
            assert torch.equal(engine_model(ids), trainer_model(ids)), dtype
    engine_model = load_model(tmp_path, fp8=CFG, fp8_storage=True)
    trainer_model = load_model(tmp_path, fp8=CFG).eval()
    engine = NativeEngine(engine_model, eos_token_ids=[257], max_model_len=64, kv_cache_memory_mb=4, seed=0)
    prompts = [[5, 6, 7, 8, 9], [100, 101, 102]]
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p,
                                           sampling=SamplingParams(max_tokens=12, n=2, seed=i, ignore_eos=True)))
    responses = []
    while engine.has_work():
        responses.extend(engine.step())
    kl, count = 0.0, 0
    with torch.no_grad():
        for r in responses:
            prompt = prompts[int(r.request_id)]
            for c in r.completions:
                ids = torch.tensor([prompt + c.token_ids])
                lp, _ = token_logprobs(trainer_model(ids), ids, 1.0)
                log_r = lp[0, len(prompt):].double() - torch.tensor(c.logprobs, dtype=torch.float64)
                kl += float((log_r.exp() - 1 - log_r).sum())
                count += len(c.logprobs)
    assert count == 48 and kl / count < 1e-3


def test_fp8_engine_loads_the_trainers_high_precision_weights_in_flight(tmp_path):
    """rl-train publishes model.dtype weights unless train.fp8.publish; an FP8 engine (rl-infer
    --fp8) quantizes them on load exactly as load_model does (it refused them: no weight_scale_inv)."""
    from rlcli.infer.receiver import load_from_files
    from rlcli.transport.atomic import atomic_dir

    trained = load_model(REPO / "recipes/models/tiny-llama", seed=0)
    trained.init_weights(seed=1, std=0.1)
    with atomic_dir(tmp_path / "step_1", {"step": 1}) as tmp:
        save_model(trained, tmp)
    engine_model = load_model(REPO / "recipes/models/tiny-llama", seed=0, fp8=CFG, fp8_storage=True)
    load_from_files(engine_model, tmp_path / "step_1")
    ref = load_model(tmp_path / "step_1", fp8=CFG, fp8_storage=True).state_dict()
    got = engine_model.state_dict()
    assert got.keys() == ref.keys() and any(k.endswith("weight_scale_inv") for k in got)
    assert all(torch.equal(got[k].view(torch.uint8) if got[k].dtype == torch.float8_e4m3fn else got[k],
                           ref[k].view(torch.uint8) if ref[k].dtype == torch.float8_e4m3fn else ref[k]) for k in got)


@torch.no_grad()
def test_fp8_experts_quantize_a_loaded_weight_into_the_blocks_already_held():
    """The native engine's decode graphs replay the expert blocks quantized at capture: after an in-place
    weight load, refresh_weights writes the new weights' blocks into the same storage (the graphs read
    it there), so the experts compute with the new weights; with nothing changed it does nothing."""
    from rlcli.ops.fp8.quant import quantize_128x128

    model = build_model(ModelArgs.from_hf(MOE))
    model.init_weights(seed=0, std=0.1)
    convert_to_fp8(model, CFG)
    mlp = model.get_submodule("model.layers.0.mlp")
    experts = mlp.experts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 160, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12)])
    gates = torch.rand(12, 2, generator=g)
    mlp.routed(x, idx, gates)  # fills the caches
    assert not experts.refresh_weights()
    held = [(c.q, c.s) for c in experts._caches]
    ptrs = [(q.data_ptr(), s.data_ptr()) for q, s in held]
    for w in (experts.w_gate, experts.w_up, experts.w_down):
        w.copy_(torch.randn(w.shape, generator=g) * 0.1)  # an in-place load
    assert experts.refresh_weights()
    assert not experts.refresh_weights()
    for (q, s), (pq, ps), w in zip(held, ptrs, (experts.w_gate, experts.w_up, experts.w_down)):
        assert (q.data_ptr(), s.data_ptr()) == (pq, ps)
        want_q, want_s = quantize_128x128(w, False)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    fresh = build_model(ModelArgs.from_hf(MOE))
    fresh.load_state_dict(model.state_dict())
    convert_to_fp8(fresh, CFG)
    torch.testing.assert_close(mlp.routed(x, idx, gates), fresh.get_submodule("model.layers.0.mlp").routed(x, idx, gates),
                               rtol=0, atol=0)
