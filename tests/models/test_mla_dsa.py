"""MLA in latent form and DeepSeek Sparse Attention: the engine's latent cache, the top-k rule
shared by training and inference, gradients, and the KV bytes the latent saves."""

import pytest
import torch
from zoo import max_abs_diff, random_ids

from rlcli.infer.engine import NativeEngine
from rlcli.models import load_model
from rlcli.ops import mla
from rlcli.protocol import GenerateRequest, SamplingParams

DSA_ARCHS = ["deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module")
def models(hf_model_dir):
    return lambda arch: load_model(hf_model_dir(arch)[0]).eval()


@torch.no_grad()
def greedy_reference(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids], device=next(model.parameters()).device))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: the engine's DSA reads its chosen tokens with the Triton kernel"))])
@pytest.mark.parametrize("arch", ["deepseek_v3", *DSA_ARCHS])
@pytest.mark.parametrize("tight", [False, True])
def test_engine_greedy_through_latent_cache_matches_full_forward(arch, tight, device, models):
    """Prompts longer than index_topk, n > 1 forks (the partial block is copied), and with a tight
    cache: preemption, recompute and chunked prefill. On CUDA the engine's DSA layers read their
    chosen tokens by cache slot with the Triton kernel, the full forward with the trainer's."""
    model = models(arch).to(device)
    if device == "cuda" and model.args.is_dsa:
        kv = torch.empty(1, model.args.kv_lora_rank + model.args.qk_rope_head_dim, device=device)
        assert mla.sparse_kernel(kv, model.args.kv_lora_rank), "the Triton kernel would not run"
    kwargs = {}
    if tight:  # room for 9 blocks of 4 tokens
        per_block = 4 * sum(h * d for layer in model.kv_cache_spec() for h, d in layer) * 4
        kwargs = {"kv_cache_memory_mb": 9 * per_block / 2**20, "block_size": 4, "max_num_batched_tokens": 8}
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, **kwargs)
    V = model.args.vocab_size
    ps = [random_ids(V, n, seed=50 + n).tolist() for n in (9, 14, 11)]
    for i, p in enumerate(ps):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p,
                                           sampling=SamplingParams(temperature=0.0, max_tokens=6, n=1 + i % 2)))
    out = {}
    while engine.has_work():
        out.update({r.request_id: r for r in engine.step()})
    for rid, resp in out.items():
        ref = greedy_reference(model, ps[int(rid)], 6)
        assert all(c.token_ids == ref for c in resp.completions), (arch, rid)
    if kwargs:
        assert engine.stats()["num_preemptions"] > 0
    layer = engine.kv_caches[-1]
    a = model.args
    assert layer[0].shape[2:] == (1, a.kv_lora_rank + a.qk_rope_head_dim)  # latent + rope key, no heads
    assert len(layer) == (2 if a.is_dsa else 1)


@torch.no_grad()
def test_dsa_with_topk_above_length_is_dense_mla_and_sparse_differs(hf_model_dir):
    """With index_topk >= length every earlier token is selected: the latent, absorbed path then
    computes exactly the expanded dense MLA of the same weights (run as deepseek_v3). With the
    configured small index_topk the logits differ, so top-k really drops tokens."""
    path, _ = hf_model_dir("deepseek_v32")
    sparse = load_model(path).eval()
    dense = load_model(path).eval()
    dense.args.index_topk = 10_000
    for layer in dense.model.layers:
        layer.self_attn.indexer.topk = 10_000
    ids = random_ids(sparse.args.vocab_size, 1, 24, seed=7)
    expanded = load_model(path).eval()
    for layer in expanded.model.layers:  # the same weights through the expanded dense path
        layer.self_attn.sparse, layer.self_attn.indexer = False, None
    ref = expanded(ids)
    assert max_abs_diff(dense(ids), ref) <= 1e-5
    k = sparse.args.index_topk
    assert max_abs_diff(sparse(ids)[:, :k], ref[:, :k]) <= 1e-5  # the first k tokens see everything
    assert max_abs_diff(sparse(ids)[:, k:], ref[:, k:]) > 1e-3


def test_selection_does_not_depend_on_chunking_and_ties_go_to_earlier_tokens(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    T, H, D, k = 40, 3, 8, 6
    q, w, keys = torch.randn(T, H, D, generator=gen), torch.randn(T, H, generator=gen), torch.randn(T, D, generator=gen)
    keys[5:15] = keys[4]  # ten tied keys
    t = torch.arange(T)
    whole = mla.select_topk(q, w, keys, torch.zeros(T, dtype=torch.long), t, k, 0.3)
    monkeypatch.setattr(mla, "CHUNK_ELEMENTS", 7)  # a few query rows at a time
    chunked = mla.select_topk(q, w, keys, torch.zeros(T, dtype=torch.long), t, k, 0.3)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    # Decode-style: one query against its own prefix gives that query's row of the full selection.
    for p in (3, 17, 39):
        one = mla.select_topk(q[p:p + 1], w[p:p + 1], keys[:p + 1], torch.zeros(1, dtype=torch.long),
                              torch.tensor([p]), k, 0.3)
        got = set(one[0][one[1]].tolist())
        assert got == set(whole[0][p][whole[1][p]].tolist())
        assert len(got) == min(k, p + 1)
    scores = mla.index_scores(q, w, keys, 0.3)
    for p in range(15, T):
        idx = whole[0][p]
        tied = [j for j in idx.tolist() if 4 <= j < 15]
        if tied and len(tied) < 11:  # a tie straddles the cut: the earliest tied tokens win
            assert tied == list(range(4, 4 + len(tied))), (p, tied, scores[p, 4])


def test_chunked_checkpointed_sparse_attention_gives_the_same_loss_and_gradients(hf_model_dir, monkeypatch):
    path, _ = hf_model_dir("glm_moe_dsa")
    ids = random_ids(97, 2, 21, seed=3)
    positions = torch.cat([torch.arange(9), torch.arange(12)])[None].expand(2, -1)  # two packed documents

    def loss_and_grads():
        model = load_model(path)
        logits = model(ids, positions)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads()
    monkeypatch.setattr(mla, "CHUNK_ELEMENTS", 40)  # many checkpointed query chunks
    loss_c, grads_c = loss_and_grads()
    assert abs(loss.item() - loss_c.item()) <= 1e-6
    assert grads.keys() == grads_c.keys() and any("kv_a_proj" in n for n in grads)
    assert not any("indexer" in n for n in grads)  # selection is not differentiable
    assert max(max_abs_diff(grads[n], grads_c[n]) for n in grads) <= 1e-5


def test_kv_bytes_per_token_latent_vs_expanded():
    """DeepSeek-V3's layer shape: 576 cached values per token instead of 128 x (192 + 128)."""
    from rlcli.models.config import ModelArgs
    from rlcli.models.hf_io import build_model
    hf = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=7168, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=128, n_routed_experts=1, num_experts_per_tok=1,
              moe_intermediate_size=8, first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    model = build_model(ModelArgs.from_hf(hf), materialize=False)
    (spec,) = model.kv_cache_spec()
    latent = sum(h * d for h, d in spec)
    expanded = 128 * (128 + 64) + 128 * 128
    assert latent == 576 and expanded / latent == pytest.approx(71.1, abs=0.1)


@torch.no_grad()
def test_absorbed_decode_reads_an_fp8_kv_b_proj_with_block_scales(hf_model_dir):
    """FP8 inference storage (DeepSeek layout: FP8 weight + 128x128 ``weight_scale_inv``) of the
    up-projection the latent path folds into queries and outputs."""
    from zoo import make_caches, paged_step, scattered_blocks
    path, _ = hf_model_dir("deepseek_v3")
    model, ref = load_model(path).eval(), load_model(path).eval()
    seq = random_ids(model.args.vocab_size, 9, seed=11)
    for layer, ref_layer in zip(model.model.layers, ref.model.layers):
        lin = layer.self_attn.kv_b_proj
        w = lin.weight  # [H * (nope + v), R]: one 128x128 block here, so one scale
        scale = w.abs().max() / 448.0
        q = (w / scale).to(torch.float8_e4m3fn)
        lin.weight = torch.nn.Parameter(q, requires_grad=False)
        lin.register_buffer("weight_scale_inv", scale.reshape(1, 1))
        ref_layer.self_attn.kv_b_proj.weight.copy_(q.float() * scale)
    outs = [paged_step(m, make_caches(m), [(seq, 0, scattered_blocks(6, 3))]) for m in (model, ref)]
    assert max_abs_diff(*outs) <= 1e-5


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
@torch.no_grad()
def test_batched_latent_decode_ignores_non_finite_padding(arch, models):
    """Two sequences of different lengths decode in one padded batch over NaN-filled caches."""
    from zoo import make_caches, paged_step, scattered_blocks
    model = models(arch)
    V = model.args.vocab_size
    short, long = random_ids(V, 3, seed=40), random_ids(V, 15, seed=41)
    caches = make_caches(model, fill=float("nan"))
    blocks = scattered_blocks(5, 5)
    tables = [blocks[:1], blocks[1:]]
    paged_step(model, caches, [(short[:2], 0, tables[0]), (long[:14], 0, tables[1])])
    step = paged_step(model, caches, [(short[2:], 2, tables[0]), (long[14:], 14, tables[1])], num_decode=2)
    assert max_abs_diff(step[0], model(short[None])[0, 2]) <= 1e-5
    assert max_abs_diff(step[1], model(long[None])[0, 14]) <= 1e-5


def test_shared_topk_layers_under_activation_checkpointing(hf_model_dir):
    """GLM-5's shared layers reuse an earlier layer's top-k; recomputing blocks in backward
    (activation checkpointing, blocks in reverse order) must read the choice the forward used."""
    from torch.utils.checkpoint import checkpoint
    path, _ = hf_model_dir("glm_moe_dsa")
    ids = random_ids(97, 1, 23, seed=5)

    def grads(checkpointed: bool):
        model = load_model(path)
        if checkpointed:
            for block in model.model.layers:
                block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
        model(ids).logsumexp(-1).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, ckpt = grads(False), grads(True)
    assert plain.keys() == ckpt.keys()
    assert max(max_abs_diff(plain[n], ckpt[n]) for n in plain) <= 1e-6


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_masked_dense_kernel_equals_gathered_kernel(arch, hf_model_dir, monkeypatch):
    """The CUDA training kernel (top-k as a boolean mask over expanded K/V, per query chunk) and the
    gathered-latent kernel compute the same loss and gradients, on packed documents."""
    path, _ = hf_model_dir(arch)
    ids = random_ids(97, 1, 30, seed=9)
    positions = torch.cat([torch.arange(18), torch.arange(12)])[None]

    def run(masked: bool):
        monkeypatch.setattr(mla, "MASKED_DENSE", masked)
        model = load_model(path)
        logits = model(ids, positions)
        logits.logsumexp(-1).mean().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (a, ga), (b, gb) = run(False), run(True)
    monkeypatch.setattr(mla, "CHUNK_ELEMENTS", 100)  # several checkpointed query chunks
    c, gc = run(True)
    assert max_abs_diff(a, b) <= 1e-5 and max_abs_diff(a, c) <= 1e-5
    assert ga.keys() == gb.keys() == gc.keys()
    assert max(max(max_abs_diff(ga[n], gb[n]), max_abs_diff(ga[n], gc[n])) for n in ga) <= 1e-5
