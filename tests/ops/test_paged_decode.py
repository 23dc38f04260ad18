"""rlcli.ops.paged_decode (the native engine's decodes on CUDA, reading the paged cache in place):
values against a float64 reference, and the engine's decodes through it against the eager paths;
and the half-precision varlen plan of a mixed step, with and without it (without it, on any CPU).

They run on CUDA. Without CUDA, where triton is installed and its interpreter works,
``test_under_the_interpreter`` runs this file in a child process on CPU tensors under Triton's
interpreter with ``RLCLI_PAGED_DECODE_ON_CPU=1`` (the engine then takes the kernel on the CPU), and
``test_zoo_decodes_under_the_interpreter`` (on CUDA hosts too) runs tests/models/test_kv_cache_decode.py
so: every architecture's paged decodes (MLA's latent cache included) through the kernel against its
full forward.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch

import interpreter

ON_CPU = os.environ.get("RLCLI_PAGED_DECODE_ON_CPU") == "1" and interpreter.ACTIVE
DEVICE = "cuda" if torch.cuda.is_available() else "cpu" if ON_CPU else None
TESTS = Path(__file__).resolve().parent.parent


def _kernels():
    if DEVICE is None:
        pytest.skip("needs CUDA; without it test_under_the_interpreter runs these")
    try:
        from rlcli.ops import paged_decode
    except (ImportError, OSError):
        pytest.skip("triton does not import")
    return paged_decode


@pytest.mark.skipif(DEVICE is not None, reason="the kernel runs here directly")
def test_under_the_interpreter():
    interpreter.run_child_or_skip(__file__, {"RLCLI_PAGED_DECODE_ON_CPU": "1"})


@pytest.mark.skipif(interpreter.ACTIVE, reason="the launcher of a child run")
def test_zoo_decodes_under_the_interpreter():
    interpreter.run_child_or_skip(str(TESTS / "models" / "test_kv_cache_decode.py"), {"RLCLI_PAGED_DECODE_ON_CPU": "1"})


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Each sequence's keys gathered from its blocks, in float64."""
    bs, groups = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = []
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=q.device)
        blocks = tables[i, pos // bs]
        k = k_cache[blocks, pos % bs].double().repeat_interleave(groups, 1)
        v = v_cache[blocks, pos % bs].double().repeat_interleave(groups, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


# (query heads, K/V heads, key width, value width): grouped heads; MLA's latent (one K/V head, the
# value a view of the key's first features); more heads than one program holds (they split);
# DeepSeek-V3's latent (512 + 64 rotary, as the engine decodes dense MLA).
SHAPES = [(4, 2, 16, 16), (8, 1, 24, 16), (40, 1, 80, 64), (16, 1, 576, 512)]
LENS = [1, 17, 100, 33, 250]  # one key; a block and one; several tiles


@pytest.mark.parametrize("splits", [None, 3, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_a_float64_reference(dtype, shape, splits):
    """Each sequence whole in one program, and its keys split over 3 and over 32 asked-for spans of at
    least one tile (``min_span=1``; trimmed to the 2 and 4 the longest fills, so the shorter sequences
    fill fewer: their spans past the context are empty and merge to nothing)."""
    K = _kernels()
    hq, hkv, d, dv = shape
    if not K.fits(hq // hkv, d, dv, dtype):
        pytest.skip("these tiles do not fit (test_the_tiles_that_do_not_fit_are_refused): the engine's eager path")
    g = torch.Generator().manual_seed(0)
    num_blocks, bs = 48, 16
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(DEVICE, dtype)
    v_cache = (k_cache[..., :dv] if dv < d else
               torch.randn(num_blocks, bs, hkv, dv, generator=g).to(DEVICE, dtype))
    k_cache[0] = float("nan")  # a block no sequence owns: never read
    owned = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(-(-n // bs) for n in LENS) + 2
    tables = torch.full((len(LENS), width), -1, dtype=torch.int64)
    for i, n in enumerate(LENS):
        for b in range(-(-n // bs)):
            tables[i, b] = owned[(i * 7 + b) % len(owned)]
    tables = tables.to(DEVICE)
    q = torch.randn(len(LENS), hq, d, generator=g).to(DEVICE, dtype)
    out = K.paged_decode(q, k_cache, v_cache, tables, torch.tensor(LENS), 0.3, max(LENS), num_splits=splits,
                         min_span=1)
    ref = reference(q, k_cache, v_cache, tables, LENS, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6 * ref.abs().max().item()  # bf16: the output's rounding
    assert out.shape == (len(LENS), hq, dv) and out.dtype == dtype
    assert (out.double() - ref).abs().max().item() <= tol


def test_the_tiles_that_do_not_fit_are_refused(tmp_path):
    """DeepSeek-V3's latent fits the kernel in bf16 and not in fp32 (262 KB of tiles: it does not compile
    on an H100/H200), so an fp32 engine decodes that MLA on the eager path, and is not graphed."""
    K = _kernels()
    assert K.fits(16, 576, 512, torch.bfloat16) and not K.fits(16, 576, 512, torch.float32)
    assert all(K.fits(hq // hkv, d, dv, torch.float32) for hq, hkv, d, dv in SHAPES[:3])
    from rlcli.ops.attention import PagedAttention, PagedAttentionMetadata

    meta = PagedAttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.int64), query_start=[0, 1],
                                  context_lens=[1], block_tables=torch.zeros(1, 1, dtype=torch.int64), block_size=16,
                                  num_decode=1)
    attn = PagedAttention([], meta, paged_decode=True)
    cache = torch.zeros(2, 16, 1, 576, device=DEVICE)
    q = torch.zeros(1, 16, 576, device=DEVICE)
    assert not attn.decodes_in_place(q, cache, cache[..., :512])
    assert attn.decodes_in_place(q.bfloat16(), cache.bfloat16(), cache.bfloat16()[..., :512])


def test_keys_split_only_where_the_programs_would_not_fill_the_gpu(monkeypatch):
    """About two programs per SM, no span shorter than MIN_SPLIT: 8 sequences x 8 K/V heads at 24k keys
    on 132 SMs split in 5; enough programs, or contexts under two spans, stay whole; never more than
    MAX_SPLITS."""
    K = _kernels()
    monkeypatch.setattr(K, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert K.num_splits_for(64, 24576, cuda) == 5
    assert K.num_splits_for(264, 24576, cuda) == 1
    assert K.num_splits_for(8, 3 * K.MIN_SPLIT, cuda) == 3
    assert K.num_splits_for(8, 2 * K.MIN_SPLIT - 1, cuda) == 1
    assert K.num_splits_for(1, 10 ** 6, cuda) == K.MAX_SPLITS  # the merge's one tile


@torch.no_grad()
def test_engine_decodes_through_the_kernel_as_through_the_eager_path(monkeypatch, tmp_path):
    """The native engine's greedy completions (prefix-shared forks, sequences of different lengths in
    one step) with the kernel and with the kernel switched off: the same tokens, logprobs within fp32."""
    K = _kernels()
    from tiny import write_tiny_model

    from rlcli.infer.engine import NativeEngine
    from rlcli.models import load_model
    from rlcli.ops import attention
    from rlcli.protocol import GenerateRequest, SamplingParams

    model = load_model(write_tiny_model(tmp_path / "m"), seed=3).to(DEVICE).eval()
    calls = []
    real = K.paged_decode
    monkeypatch.setattr(K, "paged_decode", lambda *args, **kw: calls.append(len(args[0])) or real(*args, **kw))

    def run() -> list:
        # eager steps: replayed graphs (rlcli.infer.cuda_graphs, their own test) call no Python
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=8, paged_decode=True,
                              cuda_graphs=False)
        calls.clear()  # the warm-up's, on CUDA
        for i, prompt_len in enumerate((5, 21, 9)):
            engine.add_request(GenerateRequest(
                request_id=str(i), prompt_ids=[(7 * i + j) % 250 for j in range(prompt_len)],
                sampling=SamplingParams(temperature=0.0, max_tokens=12 + 9 * i, n=2, ignore_eos=True)))
        out = []
        while engine.has_work():
            out += engine.step()
        return sorted((r.request_id, c.token_ids, c.logprobs) for r in out for c in r.completions)

    with_kernel = run()
    assert calls, "the engine's decodes did not reach the kernel"
    monkeypatch.setattr(attention, "_paged_decode_for", lambda q: None)
    eager = run()
    for (rid, tokens, logprobs), (rid2, tokens2, logprobs2) in zip(with_kernel, eager):
        assert (rid, tokens) == (rid2, tokens2)
        assert max(abs(a - b) for a, b in zip(logprobs, logprobs2)) < 1e-4


@torch.no_grad()
def test_the_engine_warms_up_the_kernel_whole_and_split(monkeypatch, tmp_path):
    """NativeEngine.warm_up decodes at WARM_UP_CONTEXTS: one sequence whole, then split in two (on an
    H100's 132 SMs, one sequence's few programs want many spans; 1,024 keys hold two); a model too
    short for a split takes the whole kernel only. Block 0 is left as it was."""
    K = _kernels()
    from tiny import write_tiny_model

    from rlcli.infer.engine import NativeEngine
    from rlcli.models import load_model

    monkeypatch.setattr(K, "_num_sms", lambda device: 132)
    splits, real = [], K.num_splits_for
    monkeypatch.setattr(K, "num_splits_for", lambda *a: splits.append(real(*a)) or splits[-1])
    calls, real_decode = [], K.paged_decode
    monkeypatch.setattr(K, "paged_decode", lambda *a, **kw: calls.append(kw["max_context_len"]) or real_decode(*a, **kw))
    model = load_model(write_tiny_model(tmp_path / "m"), seed=3).to(DEVICE).eval()
    for max_len, want in ((2 * K.MIN_SPLIT, [1, 2 * K.MIN_SPLIT]), (K.MIN_SPLIT, [1])):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=max_len, block_size=16, paged_decode=True,
                              cuda_graphs=False)
        calls.clear(), splits.clear()
        engine.warm_up()
        layers = model.args.num_hidden_layers
        assert calls == [n for n in want for _ in range(layers)]
        assert splits == [1 if n == 1 else 2 for n in want for _ in range(layers)]
        assert all(not cache[0].any() for layer in engine.kv_caches for cache in layer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts Triton's compiled kernels (CUDA)")
@torch.no_grad()
def test_after_the_warm_up_nothing_compiles(tmp_path):
    """A fresh engine's warm-up compiles the kernel whole and split and the merge; then steps of
    every table width, span count and table alignment the engine makes (prompts from 3 to 2,300 tokens,
    sequences joining and finishing) compile nothing more: the arguments that change with them are
    not specialized on. With CUDA graphs, their capture at every span count compiles nothing more either.
    Nor do the fused layers' kernels and the sampling kernel (greedy and sampled rows), which the
    warm-up compiles too."""
    K = _kernels()
    from tiny import write_tiny_model

    from rlcli.infer.engine import NativeEngine
    from rlcli.models import load_model
    from rlcli.ops import fused_kernels, sampling_kernel
    from rlcli.protocol import GenerateRequest, SamplingParams

    def variants():  # Triton's in-memory cache of compiled kernels, per device
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in (K._paged_decode_kernel, K._merge_spans_kernel)]

    others = (fused_kernels._add_rms_norm_kernel, fused_kernels._rotary_kernel, fused_kernels._silu_mul_kernel,
              sampling_kernel._sample_kernel)

    def other_variants():
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in others]

    model = load_model(write_tiny_model(tmp_path / "m"), seed=3).to("cuda").eval()
    for dtype, cuda_graphs in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        model.to(dtype)
        K._paged_decode_kernel.device_caches.clear()
        K._merge_spans_kernel.device_caches.clear()
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=4096, block_size=16, paged_decode=True,
                              kv_cache_memory_mb=64, cuda_graphs=cuda_graphs,  # graphs: captured at every span count
                              fused_kernels=True)
        assert variants() == [2, 1]
        warm = other_variants()
        assert all(warm)
        for i, n in enumerate((3, 17, 40, 700, 1100, 1600, 2300, 9, 31)):
            engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=[(5 * i + j) % 250 for j in range(n)],
                                               sampling=SamplingParams(temperature=0.0 if i % 2 else 1.0,
                                                                       max_tokens=20 + 3 * i, ignore_eos=True)))
            for _ in range(i % 3 + 1):
                engine.step()
        while engine.has_work():
            engine.step()
        assert variants() == [2, 1]
        assert other_variants() == warm
        engine.close()


def test_the_recipe_key_reaches_the_engine(tmp_path):
    """infer.engine.paged_decode (on by default; it acts on CUDA only) is the engine's and its attention backend's flag."""
    from tiny import write_tiny_model

    from rlcli.config import load_recipe
    from rlcli.infer.engine import NativeEngine
    from rlcli.models import load_model, save_model

    weights = tmp_path / "w"
    save_model(load_model(write_tiny_model(tmp_path / "m"), seed=0), weights)
    shutil.copy(tmp_path / "m" / "tokenizer_config.json", weights)
    for flag in (False, True):
        cfg = load_recipe(None, {"model.path": str(tmp_path / "m"), "infer.engine.name": "native",
                                 "infer.engine.paged_decode": flag})
        engine = NativeEngine.from_config(cfg, weights, version=0)
        assert engine.paged_decode is flag
        engine.close()
    assert load_recipe(None, {}).infer.engine.paged_decode is True


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True):
    """A stand-in for flash varlen on the CPU: each sequence in float64, bottom-right causal."""
    groups, out = q.shape[1] // k.shape[1], []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        t, n = qi.shape[0], ki.shape[0]
        scores = torch.einsum("thd,nhd->htn", qi.double(), ki.double().repeat_interleave(groups, 1)) * scale
        if causal:
            scores = scores.masked_fill(~torch.ones(t, n, dtype=torch.bool, device=q.device).tril(n - t), float("-inf"))
        out.append(torch.einsum("htn,nhd->thd", scores.softmax(-1), vi.double().repeat_interleave(groups, 1)))
    return torch.cat(out).to(q.dtype)


@pytest.mark.parametrize("paged", [False, True])
@torch.no_grad()
def test_a_mixed_steps_varlen_plan(monkeypatch, paged):
    """Half precision on CUDA: the decodes in one varlen call with their grouped heads folded into query
    rows, or through the kernel (``paged``), and the prefill chunks (one after cached keys, one whole
    prompt) in another varlen call over the contexts gathered for it (with the kernel, only theirs). On
    the CPU the varlen call is a float64 stand-in (without the kernel, in any environment), so this
    checks the plan: which slots are gathered and where each call's queries and keys are."""
    device = DEVICE if paged else (DEVICE or "cpu")
    if paged:
        _kernels()
    from rlcli.ops import attention
    from rlcli.ops.attention import PagedAttention, PagedAttentionMetadata

    calls = []
    if device == "cpu":
        monkeypatch.setattr(attention, "varlen_attention",
                            lambda *a, **kw: calls.append(a[3]) or _varlen_reference(*a, **kw))
    g = torch.Generator().manual_seed(4)
    bs, hq, hkv, d = 16, 4, 2, 16
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    k_cache = torch.randn(64, bs, hkv, d, generator=g).to(device, dtype)
    v_cache = torch.randn(64, bs, hkv, d, generator=g).to(device, dtype)
    seqs = [(70, 1), (5, 1), (33, 20), (0, 41)]  # (cached, new): two decodes, a chunk, a prompt
    owned = torch.randperm(64, generator=g).tolist()
    tables, query_start, lens = [], [0], []
    for cached, new in seqs:
        tables.append([owned.pop() for _ in range(-(-(cached + new) // bs))])
        query_start.append(query_start[-1] + new)
        lens.append(cached + new)
    width = max(len(t) for t in tables)
    meta = PagedAttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device), query_start=query_start, context_lens=lens,
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], device=device), block_size=bs,
        num_decode=2)
    q = torch.randn(query_start[-1], hq, d, generator=g).to(device, dtype)
    out = PagedAttention([(k_cache, v_cache)], meta, paged_decode=paged)._varlen(q, k_cache, v_cache, 0.25, paged)
    if device == "cpu":  # the query rows of each call: the decodes' (4 query heads over 2 K/V heads), the chunks'
        assert [c.tolist() for c in calls] == ([] if paged else [[0, 2, 4]]) + [[0, 20, 61]]
    assert meta._varlen_plan[0].numel() == (0 if paged else 71 + 6) + 53 + 41  # with the kernel, not the decodes'
    for i, (table, n) in enumerate(zip(tables, lens)):
        pos = torch.arange(n, device=device)
        slots = torch.tensor(table, device=device)[pos // bs] * bs + pos % bs
        a, b = query_start[i], query_start[i + 1]
        ref = _varlen_reference(q[a:b], k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots],
                                [0, b - a], [0, n], b - a, n, 0.25)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out[a:b].double() - ref.double()).abs().max().item() <= tol, i
