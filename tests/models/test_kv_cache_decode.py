"""Incremental decoding through the paged KV cache equals the full causal forward."""

import interpreter
import pytest
import torch
from zoo import ARCHS, make_caches, max_abs_diff, paged_step, random_ids, scattered_blocks

from rlcli.models import load_model

TOL = 1e-4
# The warm-up decodes at 1,024 positions: interpreted (tests/ops/test_paged_decode.py runs this file under
# Triton's interpreter), ~9 s a GQA architecture. There one architecture of each attention kind and an MoE;
# all of them elsewhere.
WARM_UP_ARCHS = [a for a in ARCHS if not interpreter.ACTIVE or a in ("qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32")]


@pytest.fixture(scope="module")
def models(hf_model_dir):
    return lambda arch: load_model(hf_model_dir(arch)[0]).eval()


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_prefill_then_decode_matches_full_forward(arch, models):
    model = models(arch)
    seq = random_ids(model.args.vocab_size, 17, seed=5)
    full = model(seq[None])[0]
    caches, table = make_caches(model), scattered_blocks(0, 5)
    prefill = paged_step(model, caches, [(seq[:11], 0, table)])
    diffs = [max_abs_diff(prefill, full[:11])]
    for p in range(11, 17):
        step = paged_step(model, caches, [(seq[p:p + 1], p, table)], num_decode=1)
        diffs.append(max_abs_diff(step[0], full[p]))
    assert max(diffs) <= TOL, diffs


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_chunked_prefill_matches_full_forward(arch, models):
    """A prompt prefilled over two steps (the second attends to the cached first chunk)."""
    model = models(arch)
    seq = random_ids(model.args.vocab_size, 14, seed=6)
    full = model(seq[None])[0]
    caches, table = make_caches(model), scattered_blocks(1, 4)
    first = paged_step(model, caches, [(seq[:6], 0, table)])
    second = paged_step(model, caches, [(seq[6:], 6, table)])
    diff = max_abs_diff(torch.cat([first, second]), full)
    assert diff <= TOL, diff


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_batched_steps_of_sequences_with_different_lengths(arch, models):
    """Three sequences prefilled in one step, then decoded together (one batched decode call)."""
    model = models(arch)
    V = model.args.vocab_size
    lengths, num_decode = [3, 9, 6], 4
    seqs = [random_ids(V, n + num_decode, seed=10 + i) for i, n in enumerate(lengths)]
    fulls = [model(s[None])[0] for s in seqs]
    caches = make_caches(model)
    blocks = scattered_blocks(3, 12)  # disjoint, scattered blocks for each sequence
    tables = [blocks[4 * i:4 * i + 4] for i in range(3)]
    prefill = paged_step(model, caches, [(s[:n], 0, t) for s, n, t in zip(seqs, lengths, tables)])
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    diffs = [max_abs_diff(prefill[starts[i]:starts[i + 1]], fulls[i][:n]) for i, n in enumerate(lengths)]
    for k in range(num_decode):
        step = paged_step(model, caches, [(s[n + k:n + k + 1], n + k, t) for s, n, t in zip(seqs, lengths, tables)],
                          num_decode=len(seqs))
        diffs += [max_abs_diff(step[i], fulls[i][n + k]) for i, n in enumerate(lengths)]
    assert max(diffs) <= TOL, diffs


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
@torch.no_grad()
def test_mixed_step_decodes_and_prefills_together(arch, models):
    """One step where two sequences decode while a third prefills its prompt."""
    model = models(arch)
    V = model.args.vocab_size
    a, b, c = (random_ids(V, n, seed=30 + i) for i, n in enumerate((8, 5, 7)))
    blocks = scattered_blocks(4, 9)
    ta, tb, tc = blocks[:3], blocks[3:6], blocks[6:]
    caches = make_caches(model)
    paged_step(model, caches, [(a[:7], 0, ta), (b[:4], 0, tb)])
    step = paged_step(model, caches, [(a[7:], 7, ta), (b[4:], 4, tb), (c, 0, tc)], num_decode=2)
    expected = torch.cat([model(a[None])[0, 7:], model(b[None])[0, 4:], model(c[None])[0]])
    diff = max_abs_diff(step, expected)
    assert diff <= TOL, diff


@torch.no_grad()
def test_decode_reads_the_cache(models):
    """Sanity of the harness: decoding against a cache of another prompt gives other logits."""
    model = models("llama")
    seq = random_ids(model.args.vocab_size, 9, seed=8)
    other = random_ids(model.args.vocab_size, 8, seed=9)
    full = model(seq[None])[0]
    caches, table = make_caches(model), scattered_blocks(2, 3)
    paged_step(model, caches, [(other, 0, table)])
    step = paged_step(model, caches, [(seq[8:9], 8, table)], num_decode=1)
    assert torch.isfinite(step).all() and max_abs_diff(step[0], full[8]) > TOL


@torch.no_grad()
def test_batched_decode_ignores_non_finite_values_in_padded_slots(models):
    model = models("llama")
    V = model.args.vocab_size
    short, long = random_ids(V, 3, seed=40), random_ids(V, 9, seed=41)
    caches = make_caches(model, fill=float("nan"))  # unwritten slots hold NaN (a stale, overflowed block)
    blocks = scattered_blocks(5, 4)
    tables = [blocks[:1], blocks[1:]]
    paged_step(model, caches, [(short[:2], 0, tables[0]), (long[:8], 0, tables[1])])
    step = paged_step(model, caches, [(short[2:], 2, tables[0]), (long[8:], 8, tables[1])], num_decode=2)
    assert max_abs_diff(step[0], model(short[None])[0, 2]) <= TOL


@pytest.mark.parametrize("arch", WARM_UP_ARCHS)
@torch.no_grad()
def test_engine_warm_up_leaves_the_engine_as_it_was(arch, models):
    """NativeEngine.warm_up (run at construction on CUDA) decodes a made-up token through every
    architecture's forward; afterwards the engine's greedy completions are those of an engine never
    warmed up, and once a request holds blocks it refuses to run."""
    from rlcli.infer.engine import NativeEngine
    from rlcli.protocol import GenerateRequest, SamplingParams

    model = models(arch)

    def run(warm: bool) -> list:
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=2048, block_size=8, kv_cache_memory_mb=1)
        if warm:
            engine.warm_up()
        for i in range(3):
            engine.add_request(GenerateRequest(
                request_id=str(i), prompt_ids=random_ids(model.args.vocab_size, 5 + 4 * i, seed=50 + i).tolist(),
                sampling=SamplingParams(temperature=0.0, max_tokens=6, n=2, ignore_eos=True)))
        engine.step()
        if warm:
            with pytest.raises(RuntimeError, match="every KV block is free"):
                engine.warm_up()
        out = []
        while engine.has_work():
            out += engine.step()
        return sorted((r.request_id, c.token_ids, c.logprobs) for r in out for c in r.completions)

    assert run(True) == run(False)
