"""model.batch_invariant: linears and attention whose per-token results do not depend on the batch,
and the engine and trainer giving the same logprob bits (fp32, bf16, FP8 on fp32 and bf16 masters)."""

import copy
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from rlcli.config import load_recipe
from rlcli.errors import ConfigError
from rlcli.infer.engine import NativeEngine
from rlcli.models import load_model, save_model
from rlcli.ops.attention import ForwardContext, PackedCausalAttention
from rlcli.ops import batch_invariant
from rlcli.ops.batch_invariant import invariant_attention, make_batch_invariant, pad_linear_rows, rows_mm
from rlcli.ops.logprobs import chunked_logprobs
from rlcli.config.train import LossConfig
from rlcli.protocol import GenerateRequest, SamplingParams
from rlcli.protocol.batch import Sample, build_micro_batch
from rlcli.train.loss import LOSSES
from rlcli.train.step import forward_backward, prepare

REPO = Path(__file__).resolve().parents[2]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FP8 = SimpleNamespace(enabled=True, backend="emulated", include=["*"],
                      exclude=["*embed_tokens", "lm_head", "*.mlp.gate"], ue8m0=False)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_linear_rows_do_not_depend_on_the_row_count(dtype, two_threads):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(192, 320, bias=False).to(dtype)
    assert pad_linear_rows(lin) == 1 and pad_linear_rows(lin) == 0  # idempotent
    x = torch.randn(40, 192, generator=g).to(dtype)
    w = torch.randn(259, 192, generator=g).to(dtype)
    # At this process's thread count; the one-thread case (what the engine and the trainer pin)
    # runs in a child below, which leaves this process's count alone.
    with torch.no_grad():
        ref = lin(x)
        for m in range(1, 40):
            assert torch.equal(lin(x[:m]), ref[:m]), m
            assert torch.equal(lin(x[m // 2:m]), ref[m // 2:m]), m  # another place in its block
            assert torch.equal(rows_mm(x[:m], w.T), rows_mm(x, w.T)[:m]), m
        assert lin(x[None, :3]).shape == (1, 3, 320)


_ONE_THREAD_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from procs import write_recipe
from rlcli.config import load_recipe
from rlcli.infer.engine import NativeEngine
from rlcli.models import load_model
from rlcli.ops.batch_invariant import pad_linear_rows
from rlcli.train.trainer import Trainer
from rlcli.transport.rundir import RunDir

model_dir, tmp = sys.argv[1], sys.argv[3]
torch.set_num_threads(2)
NativeEngine(load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32, seed=0), eos_token_ids=[],
             max_model_len=64, batch_invariant=True)
assert torch.get_num_threads() == 1, "engine"
torch.set_num_threads(2)
recipe = write_recipe(__import__("pathlib").Path(tmp) / "r.toml", model_dir, tmp + "/run",
                      model={"batch_invariant": True}, train={"threads": "adaptive", "num_threads": 2})
cfg = load_recipe(recipe)
trainer = Trainer(cfg, RunDir(cfg.run_dir))
assert torch.get_num_threads() == 1 and trainer.cores is None, "trainer"
trainer.close()
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    lin = torch.nn.Linear(1024, 512, bias=False).to(dtype)  # K of 1024: where MKL splits over threads
    pad_linear_rows(lin)
    x = torch.randn(70, 1024, generator=g).to(dtype)
    with torch.no_grad():
        ref = lin(x)
        for m in range(1, 70, 3):
            assert torch.equal(lin(x[:m]), ref[:m]) and torch.equal(lin(x[m // 2:m]), ref[m // 2:m]), (dtype, m)
print("ok")
"""


@pytest.mark.parametrize("bias", [False, True])
def test_a_padded_linear_backward_is_the_plain_linear_backward(bias):
    """Only the forward runs in row blocks: a plain linear's gradients are whole-matrix GEMMs,
    the same numbers as nn.Linear's (an FP8 linear keeps its own autograd)."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 48, bias=bias)
    padded = torch.nn.Linear(64, 48, bias=bias)
    padded.load_state_dict(plain.state_dict())
    assert pad_linear_rows(padded) == 1 and type(padded).plain_linear
    x = torch.randn(3, 37, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(3, 37, 48)
    plain(x1).backward(dy)
    padded(x2).backward(dy)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(padded.weight.grad, plain.weight.grad, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(padded.bias.grad, plain.bias.grad, rtol=1e-6, atol=1e-6)
    view = padded(x).grad_fn  # [rows, N] -> [3, 37, N]
    assert view.next_functions[0][0].name().startswith("_BlockedLinearFn")


def test_engine_and_trainer_run_on_one_thread_under_the_flag(tiny_model_dir, tmp_path):
    """Two thread counts split a GEMM's reduction differently (MKL on AVX-512), so both sides
    pin one thread when their model is made batch-invariant (adaptive threads off), and on one
    thread the blocked linears give a row the same bits whatever rows come with it. In a child
    process: the thread count of this one stays as it is."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ONE_THREAD_CHILD, str(tiny_model_dir),
                          str(Path(__file__).resolve().parents[1]), str(tmp_path)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # the trainer takes a GPU it sees
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_gives_a_query_the_same_bits_in_every_batch_shape(dtype):
    """A [T, T] causal forward, prefill chunks after cached keys, and one decode step per query
    next to other sequences whose padding holds huge values: equal bits; close to SDPA."""
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D = 45, 6, 2, 16
    q, k, v = (torch.randn(1, h, T, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    # Known exception (module docstring of rlcli.ops.batch_invariant): the process's first exp after
    # the tests before was seen to round differently, about 1 time in 5 (torch 2.13, AVX-512). One
    # call first, so that what is tested is this function's order, not that.
    invariant_attention(q, k, v, 0.25)
    full = invariant_attention(q, k, v, 0.25)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(full.float(), ref, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)
    for chunk in (1, 7, 32):
        parts = [invariant_attention(q[:, :, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk], 0.25)
                 for s in range(0, T, chunk)]
        assert torch.equal(torch.cat(parts, dim=2), full), chunk
    width = 64
    for p in (0, 5, 31, 32, 44):
        kb, vb = (torch.full((3, Hkv, width, D), 1e30, dtype=dtype) for _ in range(2))
        kb[1, :, :p + 1], vb[1, :, :p + 1] = k[0, :, :p + 1], v[0, :, :p + 1]
        kb[0], vb[0], kb[2], vb[2] = 0.5, 0.25, -0.5, 1.0
        qb = torch.randn(3, Hq, 1, D, generator=g).to(dtype)
        qb[1] = q[0, :, p:p + 1]
        out = invariant_attention(qb, kb, vb, 0.25, torch.tensor([7, p + 1, width]))
        assert torch.equal(out[1, :, 0], full[0, :, p]), p
        assert torch.isfinite(out).all()


def test_invariant_attention_chunks_long_rows_over_queries_without_changing_a_bit(monkeypatch):
    import rlcli.ops.batch_invariant as bi

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 50, 8, generator=g) for h in (4, 2, 2))
    lens = torch.tensor([50, 41])
    whole = invariant_attention(q, k, v, 0.3, lens)
    monkeypatch.setattr(bi, "_MAX_ELEMENTS", 2 * 4 * 50 * 9 * 7)  # chunks of 7 queries
    chunked = invariant_attention(q, k, v, 0.3, lens)
    # Row 1 holds 41 keys: its first 9 queries see none (NaN, never asked for), the rest are its own.
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1, :, 9:], whole[1, :, 9:])
    assert torch.equal(invariant_attention(q[1:, :, 9:], k[1:], v[1:], 0.3, lens[1:]), whole[1:, :, 9:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dsa_indexer_and_sparse_attention_give_a_query_the_same_bits_in_every_batch(dtype):
    """The trainer's view of a query (a packed row: another document's 290 tokens, then its own, all
    of them scored together) and the engine's (its document alone, a decode batch of per-query keys)
    under the flag: equal index scores, the same chosen tokens in the same slots (its window holds
    fewer tokens than top-k, so padding fills the rest), and equal sparse attention outputs,
    though k differs (48 in the row, 40 alone). Close to the default kernels."""
    from rlcli.ops.mla import index_scores, invariant_sparse_attention, select_topk, sparse_latent_attention

    g = torch.Generator().manual_seed(3)
    Hi, Di, H, L, R, topk, pre, n = 4, 64, 4, 24, 16, 48, 290, 40
    iq = torch.randn(pre + n, Hi, Di, generator=g).to(dtype)
    iw = torch.rand(pre + n, Hi, generator=g)
    ik = torch.randn(pre + n, Di, generator=g).to(dtype)
    q, kv = torch.randn(pre + n, H, L, generator=g).to(dtype), torch.randn(pre + n, L, generator=g).to(dtype)
    rows = torch.arange(pre + n)
    lo = torch.where(rows < pre, 0, pre)
    row_scores = index_scores(iq, iw, ik, 0.2, invariant=True)
    ref = index_scores(iq, iw, ik, 0.2)
    torch.testing.assert_close(row_scores, ref, atol=1e-4 if dtype == torch.float32 else 1e-2, rtol=1e-4)
    idx, valid = select_topk(iq, iw, ik, lo, rows, topk, 0.2, invariant=True)
    out = invariant_sparse_attention(q, kv, idx, valid, R, 0.3)
    torch.testing.assert_close(out.float(), sparse_latent_attention(q, kv, idx, valid, R, 0.3).float(),
                               atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    for t in (3, 25, 39):  # the doc's tokens 0..t
        own, one = slice(pre, pre + t + 1), slice(pre + t, pre + t + 1)
        alone = index_scores(iq[one], iw[one], ik[own][None], 0.2, invariant=True)
        assert torch.equal(alone[0], row_scores[pre + t, own]), t
        # Per-query keys padded past the query (a decode batch), and shared keys ending at it (a prefill chunk).
        for keys in (torch.cat([ik[own], torch.full((n - t - 1, Di), 7.0, dtype=dtype)])[None], ik[own]):
            i1, v1 = select_topk(iq[one], iw[one], keys, torch.tensor([0]), torch.tensor([t]), topk, 0.2,
                                 invariant=True)
            k1 = i1.shape[1]
            assert k1 == min(topk, keys.shape[-2]) < idx.shape[1] == topk
            assert torch.equal(v1[0], valid[pre + t, :k1]) and not valid[pre + t, k1:].any()
            assert torch.equal(i1[0][v1[0]] + pre, idx[pre + t][valid[pre + t]]), t
            o1 = invariant_sparse_attention(q[one], kv[own], i1, v1, R, 0.3)
            assert torch.equal(o1[0], out[pre + t]), (t, k1)


def test_invariant_attention_backend_trains():
    """The trainer's backend: packed documents, gradients close to the sdpa backend's."""
    g = torch.Generator().manual_seed(1)
    pos = torch.tensor([list(range(20)) + list(range(13))])
    q, k, v = (torch.randn(1, 33, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    outs = {}
    for backend in ("invariant", "sdpa"):
        out = PackedCausalAttention(pos, backend=backend)(0, q, k, v, 0.25)
        grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
        outs[backend] = (out, *grads)
    for a, b in zip(outs["invariant"], outs["sdpa"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _trainer_logprobs(model, prompt: list[int], completions: list[list[int]], temperature: float = 1.0,
                      top_p: float = 1.0) -> list[torch.Tensor]:
    """rl-train's path: completions packed into one row, invariant attention, chunked_logprobs."""
    ids, pos, index, targets = [], [], [], []
    for c in completions:
        index += [len(ids) + len(prompt) - 1 + j for j in range(len(c))]
        targets += c
        ids += prompt + c
        pos += range(len(prompt) + len(c))
    dev = model.lm_head.weight.device
    ids_t, pos_t = torch.tensor([ids], device=dev), torch.tensor([pos], device=dev)
    h = model.hidden_states(ids_t, pos_t, ForwardContext(attn=PackedCausalAttention(pos_t, backend="invariant")))[0]
    lp, _ = chunked_logprobs(h.index_select(0, torch.tensor(index, device=dev)), model.lm_head.weight,
                             torch.tensor(targets, device=dev), temperature, top_p=top_p)
    return list(lp.split([len(c) for c in completions]))


def _assert_engine_logprobs_equal(trainer_model, prompts, responses, temperature: float = 1.0,
                                  top_p: float = 1.0) -> int:
    """Every logprob the engine reported equals the trainer's recomputation bit for bit; returns how
    many were finite."""
    finite = 0
    with torch.no_grad():
        for r in responses:
            completions = [c.token_ids for c in r.completions]
            lps = _trainer_logprobs(trainer_model, prompts[int(r.request_id)], completions, temperature, top_p)
            for c, lp in zip(r.completions, lps):
                assert torch.equal(lp.cpu(), torch.tensor(c.logprobs, dtype=torch.float32)), (r.request_id, lp,
                                                                                             c.logprobs)
                finite += int(torch.isfinite(lp).sum())
    return finite


def _engine_against_trainer(tmp_path, model_name: str | Path, device, dtype, fp8, seed: int, prompt_lens,
                            **sampling):
    """Random weights saved once; an engine under the flag (prompts prefilled in 16-token chunks)
    generates 8 tokens x 2 completions per prompt; returns (the trainer's model under the flag,
    the prompts, the engine's responses). ``model_name``: a recipes/models directory, or a path."""
    model = load_model(model_name if isinstance(model_name, Path) else REPO / "recipes/models" / model_name, seed=0)
    model.init_weights(seed=0, std=0.1)
    save_model(model, tmp_path)
    engine_model = load_model(tmp_path, device=device, dtype=dtype, fp8=fp8, fp8_storage=True)
    trainer_model = load_model(tmp_path, device=device, dtype=dtype, fp8=fp8).eval()
    make_batch_invariant(trainer_model)
    engine = NativeEngine(engine_model, eos_token_ids=[257], max_model_len=64, kv_cache_memory_mb=4, seed=0,
                          max_num_batched_tokens=16, batch_invariant=True)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, min(256, model.args.vocab_size), (n,), generator=g).tolist() for n in prompt_lens]
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, sampling=SamplingParams(
            max_tokens=8, n=2, seed=i, ignore_eos=True, **sampling)))
    responses = []
    while engine.has_work():
        responses.extend(engine.step())
    return trainer_model, prompts, responses


@pytest.fixture(autouse=True)
def invariant_mode():
    """Whatever an engine switched on process-wide (rlcli.ops.batch_invariant.enable) is switched off after."""
    yield
    batch_invariant.enable(False)


def test_make_batch_invariant_swaps_norms_and_wraps_each_fp8_backend_once():
    """Stacked siblings keep one shared backend (a wrapper per backend, not per linear); norms get
    the kernel subclass; on the CPU the outputs stay the model's (rows blocked, values close); idempotent."""
    from rlcli.models.layers import RMSNorm
    from rlcli.ops.fp8.convert import convert_to_fp8
    from rlcli.ops.fp8.linear import FP8Linear

    model = load_model(REPO / "recipes/models/tiny-llama", seed=0)
    convert_to_fp8(model, SimpleNamespace(**vars(FP8), fuse_siblings=["qkv", "gate_up"]))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        before = model(ids)
    inner = {id(m.backend) for m in model.modules() if isinstance(m, FP8Linear)}
    stacked = sum(m.sibling_group is not None for m in model.modules() if isinstance(m, FP8Linear))
    make_batch_invariant(model)
    make_batch_invariant(model)
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    backends = {id(m.backend) for m in fp8}
    assert len(backends) == len(inner) and all(isinstance(m.backend, batch_invariant.KernelGemm) for m in fp8)
    assert stacked and sum(m.sibling_group is not None for m in fp8) == stacked
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(isinstance(m, batch_invariant._KernelNorm) for m in norms)
    # Close, not equal: blocked rows may round differently (the GEMM library picks kernels by row count,
    # on some CPUs), and FP8's quantization can turn that into a whole FP8 step (0.008 seen on a 16-core host).
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before, atol=0.03, rtol=0)
        torch.testing.assert_close(copy.deepcopy(model)(ids), before, atol=0.03, rtol=0)  # the wrappers copy too
    assert torch.equal(batch_invariant.row_sum(before[0]), before[0].sum(-1))


def test_batch_invariant_setup_names_the_devices_it_runs_on(monkeypatch):
    with pytest.raises(ConfigError, match="CPU and CUDA"):
        batch_invariant.batch_invariant_setup(torch.device("meta"))
    monkeypatch.setattr(batch_invariant, "kernels_available", lambda: False)
    with pytest.raises(ConfigError, match="install triton"):
        batch_invariant.batch_invariant_setup(torch.device("cuda"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, FP8),
                                       (torch.bfloat16, FP8)], ids=["fp32", "bf16", "fp8-fp32", "fp8-bf16"])
def test_engine_and_trainer_logprobs_are_bitwise_equal(tmp_path, dtype, fp8, device):
    """Several sequences in flight, prompts prefilled in chunks of 16 tokens, n = 2 forks: every
    logprob the engine reports equals the trainer's recomputation bit for bit, and rl-train's own
    step (forward_backward on a packed row, prompts shared or not) measures a mismatch of 0.
    On CUDA both sides run rlcli.ops.invariant_kernels."""
    trainer_model, prompts, responses = _engine_against_trainer(tmp_path, "tiny-llama", device, dtype, fp8, 3,
                                                                (5, 23, 37))
    assert len(responses) == 3
    _assert_engine_logprobs_equal(trainer_model, prompts, responses)
    samples = [Sample(token_ids=prompts[int(r.request_id)] + c.token_ids, advantage=1.0, logprobs=c.logprobs,
                      num_prompt_tokens=len(prompts[int(r.request_id)]), versions=c.versions)
               for r in responses for c in r.completions]
    for share in (False, True):
        t = prepare(build_micro_batch(samples, 1.0, share_prompts=share), torch.device(device))
        metrics = forward_backward(trainer_model.train(), t, torch.tensor(1.0), LOSSES["icepop"], LossConfig(),
                                   1024, attention="invariant")
        assert metrics["logprob_diff_abs_max"] == 0 and metrics["mismatch_kl"] == 0, (share, metrics)


def _assert_bitwise_with_r3(trainer_model, prompts, responses, device) -> None:
    """Every engine logprob equals the trainer's recomputation, and rl-train's step replaying the
    engine's routes (R3) measures mismatch 0 and router disagreement 0."""
    _assert_engine_logprobs_equal(trainer_model, prompts, responses)
    samples = [Sample(token_ids=prompts[int(r.request_id)] + c.token_ids, advantage=1.0, logprobs=c.logprobs,
                      num_prompt_tokens=len(prompts[int(r.request_id)]), versions=c.versions,
                      routed_experts=c.routed_experts)
               for r in responses for c in r.completions]
    t = prepare(build_micro_batch(samples, 1.0), torch.device(device))
    metrics = forward_backward(trainer_model.train(), t, torch.tensor(1.0), LOSSES["icepop"], LossConfig(), 1024,
                               r3=True, attention="invariant")
    assert metrics["logprob_diff_abs_max"] == 0 and metrics["mismatch_kl"] == 0, metrics
    assert metrics["router_pairs"] > 0 and metrics["router_disagree"] == 0, metrics


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, FP8)],
                         ids=["fp32", "bf16", "fp8-bf16"])
def test_moe_engine_and_trainer_logprobs_are_bitwise_equal(tmp_path, dtype, fp8, device):
    """A Qwen3-MoE (8 experts, top-2; FP8 experts in the fp8 case) under the flag: the router's
    linear and every expert's GEMMs are batch-invariant (blocked rows on the CPU, the grouped
    kernels on CUDA), so the engine's logprobs equal the trainer's bit for bit whether the trainer
    routes by itself or replays the engine's routes (R3), with a router disagreement of 0."""
    trainer_model, prompts, responses = _engine_against_trainer(tmp_path, "tiny-qwen3-moe", device, dtype, fp8, 4,
                                                                (6, 21, 30), return_routing=True)
    _assert_bitwise_with_r3(trainer_model, prompts, responses, device)


def _tiny_deepseek_v3(root: Path) -> Path:
    """A DeepSeek-V3 config (MLA with a query LoRA and YaRN; sigmoid group-limited routing, shared
    experts, a dense first layer) written where load_model reads it."""
    import json

    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}).to_dict()
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**cfg, "architectures": ["DeepseekV3ForCausalLM"]}))
    return root


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, FP8)],
                         ids=["fp32", "bf16", "fp8-bf16"])
def test_mla_engine_and_trainer_logprobs_are_bitwise_equal(tmp_path, dtype, fp8, device):
    """DeepSeek-V3 (dense MLA + MoE) under the flag: the trainer attends in the engine's latent form
    (absorbed projections per head on invariant rows, one latent K/V head through the invariant
    attention; FP8's kv_b_proj absorbed as the FP8 engine holds it), so the engine's logprobs equal the
    trainer's bit for bit, with R3 and a router disagreement of 0."""
    config = _tiny_deepseek_v3(tmp_path / "config")
    trainer_model, prompts, responses = _engine_against_trainer(tmp_path / "weights", config, device, dtype, fp8, 6,
                                                                (5, 20, 33), return_routing=True)
    _assert_bitwise_with_r3(trainer_model, prompts, responses, device)
    grads = [p.grad for p in trainer_model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def _tiny_deepseek_v32(root: Path, **over) -> Path:
    """A DeepSeek-V3.2 config (DSA: an indexer choosing 24 tokens per query, so the longer prompts
    below are sparse from their 25th token) written where load_model reads it."""
    import json

    import transformers

    cfg = transformers.DeepseekV32Config(**{
        **dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
               topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, index_topk=24, index_n_heads=4, index_head_dim=16), **over}).to_dict()
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**cfg, "architectures": ["DeepseekV32ForCausalLM"]}))
    return root


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, FP8)],
                         ids=["fp32", "bf16", "fp8-bf16"])
def test_dsa_engine_and_trainer_logprobs_are_bitwise_equal(tmp_path, dtype, fp8, device):
    """DeepSeek-V3.2 (DSA + MoE) under the flag: the indexer's scores, its top-k and the sparse
    attention over the chosen tokens give a query the same bits in the engine's decode batch and
    prefill chunks as in the trainer's packed row (where earlier documents sit before its window),
    so the engine's logprobs equal the trainer's bit for bit, with R3 and a router disagreement of 0."""
    if batch_invariant._KERNELS_ON_CPU:
        pytest.skip("under Triton's interpreter the DSA model's logprobs differ by an ulp (not found on an H100, "
                    "where this ran on the kernels, nor on the CPU path; the cause is not found)")
    config = _tiny_deepseek_v32(tmp_path / "config")
    trainer_model, prompts, responses = _engine_against_trainer(tmp_path / "weights", config, device, dtype, fp8, 7,
                                                                (5, 20, 33), return_routing=True)
    _assert_bitwise_with_r3(trainer_model, prompts, responses, device)
    grads = [p.grad for n, p in trainer_model.named_parameters() if p.requires_grad and ".indexer." not in n]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_the_flag_refuses_dsa_widths_its_cuda_kernels_do_not_take(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_invariant, "_on_cuda", lambda model: True)
    make_batch_invariant(load_model(_tiny_deepseek_v32(tmp_path / "ok"), device="meta"))
    with pytest.raises(ConfigError, match="this model's are 1024, 8 and 16: set model.batch_invariant = false"):
        make_batch_invariant(load_model(_tiny_deepseek_v32(tmp_path / "wide", kv_lora_rank=1024), device="meta"))


def test_engine_logprobs_match_the_trainer_under_temperature_and_top_p(tmp_path):
    model = load_model(REPO / "recipes/models/tiny-llama", seed=0)
    model.init_weights(seed=0, std=0.1)
    pad_linear_rows(model)
    engine = NativeEngine(load_model(REPO / "recipes/models/tiny-llama", seed=0), eos_token_ids=[257],
                          max_model_len=64, kv_cache_memory_mb=4, seed=0, batch_invariant=True)
    engine.model.load_state_dict(model.state_dict())
    prompts = {"a": ([5, 6, 7, 8], 0.7, 0.9), "b": ([100, 101, 102, 103, 104, 105], 1.3, 1.0)}
    for rid, (p, temp, top_p) in prompts.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_ids=p, sampling=SamplingParams(
            max_tokens=8, n=2, seed=1, temperature=temp, top_p=top_p, ignore_eos=True)))
    responses = []
    while engine.has_work():
        responses.extend(engine.step())
    with torch.no_grad():
        for r in responses:
            p, temp, top_p = prompts[r.request_id]
            lps = _trainer_logprobs(model.eval(), p, [c.token_ids for c in r.completions], temp, top_p)
            for c, lp in zip(r.completions, lps):
                assert torch.equal(lp, torch.tensor(c.logprobs, dtype=torch.float32)), (r.request_id, lp, c.logprobs)


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_logprobs_are_bitwise_equal_on_every_device(tmp_path, device):
    """top_p < 1 under the flag: the nucleus (a stable sort, the cumulative sum, the logsumexp over
    it) gives the engine's rows, one or several at a time, the trainer's bits (on CUDA torch's
    cumsum scans a lone row by another algorithm than a batch)."""
    trainer_model, prompts, responses = _engine_against_trainer(tmp_path, "tiny-llama", device, torch.bfloat16, None,
                                                                5, (4, 19), temperature=0.8, top_p=0.85)
    kept = _assert_engine_logprobs_equal(trainer_model, prompts, responses, 0.8, 0.85)
    assert kept == 2 * 2 * 8  # every sampled token inside the trainer's nucleus


def test_batch_invariant_refuses_compiled_blocks_and_vllm():
    with pytest.raises(ConfigError, match="train.compile"):
        load_recipe(None, {"model.batch_invariant": True, "train.compile": True})
    with pytest.raises(ConfigError, match="infer.engine.name"):
        load_recipe(None, {"model.batch_invariant": True, "infer.engine.name": "vllm"})
    assert load_recipe(None, {"model.batch_invariant": True}).model.batch_invariant
