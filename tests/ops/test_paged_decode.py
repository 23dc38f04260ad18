"""rlcli.ops.paged_decode (the native engine's decodes on CUDA, reading the paged cache in place):
values against a float64 reference, and the engine's decodes through it against the eager paths.

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
    reason = interpreter.unusable()
    if reason:
        pytest.skip(reason)
    interpreter.run_child(__file__, {"RLCLI_PAGED_DECODE_ON_CPU": "1"})


@pytest.mark.skipif(interpreter.ACTIVE, reason="the launcher of a child run")
def test_zoo_decodes_under_the_interpreter():
    reason = interpreter.unusable()
    if reason:
        pytest.skip(reason)
    interpreter.run_child(str(TESTS / "models" / "test_kv_cache_decode.py"), {"RLCLI_PAGED_DECODE_ON_CPU": "1"})


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
# value a view of the key's first features); more heads than one program holds (they split).
SHAPES = [(4, 2, 16, 16), (8, 1, 24, 16), (40, 1, 80, 64)]
LENS = [1, 17, 100, 33, 250]  # one key; a block and one; several tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_a_float64_reference(dtype, shape):
    K = _kernels()
    hq, hkv, d, dv = shape
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
    out = K.paged_decode(q, k_cache, v_cache, tables, torch.tensor(LENS), 0.3)
    ref = reference(q, k_cache, v_cache, tables, LENS, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6 * ref.abs().max().item()  # bf16: the output's rounding
    assert out.shape == (len(LENS), hq, dv) and out.dtype == dtype
    assert (out.double() - ref).abs().max().item() <= tol


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
    monkeypatch.setattr(K, "paged_decode", lambda *args: calls.append(len(args[0])) or real(*args))

    def run() -> list:
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=8, paged_decode=True)
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


def test_the_recipe_key_reaches_the_engine(tmp_path):
    """infer.engine.paged_decode (off by default) is the engine's and its attention backend's flag."""
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
    assert load_recipe(None, {}).infer.engine.paged_decode is False
