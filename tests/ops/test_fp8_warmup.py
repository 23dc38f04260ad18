"""DeepGEMM's JIT warm-up (rlcli.ops.fp8.warmup) against a CPU stand-in for deep_gemm.

The stand-in is a package on sys.path (and on the workers' PYTHONPATH) named ``deep_gemm``: its
GEMMs pick a tile configuration from M the way DeepGEMM's heuristic does (through tile counts
``ceil(M / b)`` and comparisons of M with the tile sizes and with 512), and "compile" a kernel the first time
a (kind, N, K, groups, configuration) is met by creating an entry in ``$DG_JIT_CACHE_DIR/cache``.
On the GPU the real DeepGEMM runs (docs/benchmarks.md); here the tests check what the warm-up
itself promises: the shapes it finds, its grid, its worker processes, and that after it no token
count compiles anything.
"""

import os
import random
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from rlcli.models import ModelArgs, build_model
from rlcli.ops.fp8 import warmup
from rlcli.ops.fp8.convert import convert_to_fp8
from rlcli.ops.fp8.warmup import GemmShape

FAKE_DG = '''
"""A CPU stand-in for deep_gemm (tests/ops/test_fp8_warmup.py)."""
import math, os, sys, time
from pathlib import Path

__version__ = "stand-in"
SMS = 132


def _config(m, n):
    # DeepGEMM 2.5's SM90 heuristic in outline: over tiles (block_m, block_n), the fewest waves, then the
    # fullest last wave, then a tie-break that compares m with the tile (block_m <= m); tiles 16 and 32
    # along M only for m <= 16, 32; 2-way multicast from m >= 512 when the M tile count is even
    best = None
    for bm in (64, 128, 256) + ((16,) if m <= 16 else ()) + ((32,) if m <= 32 else ()):
        for bn in range(16, 257, 16):
            if bm > 128 and bn > 128:
                continue
            blocks = math.ceil(m / bm) * math.ceil(n / bn)
            waves = math.ceil(blocks / SMS)
            key = (waves, -(blocks - (waves - 1) * SMS), bm > m, -bn, bm)
            best = min(best or (key, bm, bn), (key, bm, bn))
    _, bm, bn = best
    return bm, bn, 2 if m >= 512 and math.ceil(m / bm) % 2 == 0 else 1


def _kernel(*key):
    time.sleep(float(os.environ.get("FAKE_DG_CALL_S", "0")))
    d = Path(os.environ["DG_JIT_CACHE_DIR"]) / "cache" / ("kernel." + ".".join(map(str, key)))
    if not d.exists():
        if os.environ.get("FAKE_DG_CRASH"):
            os._exit(3)
        sys.stderr.write("compiler output " * 16384 * int(os.environ.get("FAKE_DG_NOISE", "0")))  # 256 KiB each
        d.mkdir(parents=True, exist_ok=True)


def get_mk_alignment_for_contiguous_layout():
    return 128


def fp8_gemm_nt(a, b, out, c=None, recipe=None, compiled_dims="nk"):
    (m, k), n = a[0].shape, b[0].shape[0]
    assert k % 128 == 0
    if compiled_dims == "mn":  # a weight gradient: K (the tokens) at run time, but its last stages compiled
        _kernel("1d1d", m, n, *_config(m, n), math.ceil(k / 128) % 5)
    else:
        _kernel("gemm", n, k, *_config(m, n))
    out.zero_()


def m_grouped_fp8_gemm_nt_contiguous(a, b, out, layout):
    m, (g, n, k) = a[0].shape[0], b[0].shape
    assert m % 128 == 0
    assert n % 64 == 0, "N must be a multiple of 64"
    _kernel("grouped", g, n, k, *_config(m, n))
    out.zero_()
'''

MOE = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 256, "intermediate_size": 384,
       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True,
       "mlp_only_layers": [1]}


@pytest.fixture
def fake_dg(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "deep_gemm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_DG))
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pkg.parent), *sys.path]))
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "jit"))
    monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
    import deep_gemm

    yield deep_gemm
    sys.modules.pop("deep_gemm", None)


def _moe_model(backend, fuse=("qkv",)):
    model = build_model(ModelArgs.from_hf(MOE), device="meta")
    cfg = SimpleNamespace(backend="deep_gemm", include=["*"], exclude=["*embed_tokens", "lm_head", "*.mlp.gate"],
                          ue8m0=False, fuse_siblings=list(fuse))
    convert_to_fp8(model, cfg, backend=backend)
    return model


def test_the_shapes_are_each_converted_gemm_forward_and_for_training_its_input_gradient(fake_dg):
    from rlcli.ops.fp8.backends import DeepGemmBackend

    model = _moe_model(DeepGemmBackend(fake_dg))  # on the meta device, as rl-train calls it
    infer = set(warmup.model_shapes(model, backward=False))
    # q/k/v stacked (256 + 128 + 128 out), o_proj, the dense MLP of layer 1, the 4 experts' gate/up and down
    assert infer == {GemmShape("gemm", 512, 256), GemmShape("gemm", 256, 256), GemmShape("gemm", 384, 256),
                     GemmShape("gemm", 256, 384), GemmShape("grouped", 128, 256, 4), GemmShape("grouped", 256, 128, 4)}
    train = set(warmup.model_shapes(model, backward=True))
    wgrads = {GemmShape("wgrad", 512, 256), GemmShape("wgrad", 256, 256), GemmShape("wgrad", 384, 256),
              GemmShape("wgrad", 256, 384)}  # the linears' (the experts' weight gradients are bf16)
    assert train == infer | {GemmShape("gemm", 256, 512)} | wgrads  # dgrads: the transposed shapes
    under_ep = set(warmup.model_shapes(model, backward=True, ep=2))  # each rank holds half the experts
    assert GemmShape("grouped", 128, 256, 2) in under_ep and GemmShape("grouped", 128, 256, 4) not in under_ep
    unfused = set(warmup.model_shapes(_moe_model(DeepGemmBackend(fake_dg), fuse=()), backward=False))
    assert GemmShape("gemm", 128, 256) in unfused and GemmShape("gemm", 512, 256) not in unfused


def test_after_the_warm_up_no_token_count_compiles_a_kernel(fake_dg):
    """The sweep runs in real worker processes; afterwards every M up to the bound, dense and grouped,
    finds its kernel (the stand-in's cache gains nothing), and a second warm-up compiles nothing."""
    from rlcli.ops.fp8 import runtime
    from rlcli.ops.fp8.backends import DeepGemmBackend

    shapes = [GemmShape("gemm", 4096, 256), GemmShape("gemm", 256, 4096), GemmShape("grouped", 256, 128, 4),
              GemmShape("wgrad", 4096, 256)]
    report = warmup.warm_up(shapes, max_tokens=700, max_rows=1400, device="cpu", workers=2)
    assert report.errors == [] and report.workers == 2
    assert report.compiled > len(shapes) and report.missed == 0
    before = warmup.cached_kernels()
    be = DeepGemmBackend(fake_dg, strict=True)
    rng = random.Random(1)
    w = runtime.quantize_weight(torch.randn(4096, 256, dtype=torch.bfloat16), False)
    for m in range(1, 701):  # every M
        be.gemm(*runtime.quantize_act(torch.randn(m, 256, dtype=torch.bfloat16), False), *w, torch.bfloat16)
    wg = runtime.quantize_weight(torch.randn(4, 256, 128, dtype=torch.bfloat16), False)
    for rows in rng.sample(range(1, 1401), 40):
        offs = torch.tensor([rows // 4, rows // 2, 3 * rows // 4, rows], dtype=torch.int32)  # uneven experts
        be.grouped_gemm_x(torch.randn(rows, 128, dtype=torch.bfloat16), False, *wg, offs, torch.bfloat16)
    dy = torch.randn(700, 4096, dtype=torch.bfloat16)
    for m in range(1, 701):  # weight gradients of every token count, as rlcli.ops.fp8.linear.wgrad quantizes them
        be._wgrad_1d1d(*runtime.quantize_act(dy[:m], False, rows=False, cols=True),
                       *runtime.quantize_act(torch.randn(m, 256, dtype=torch.bfloat16), False, rows=False, cols=True))
    assert warmup.cached_kernels() == before
    again = warmup.warm_up(shapes, max_tokens=700, max_rows=1400, device="cpu", workers=0)
    assert again.compiled == 0 and again.missed == 0


def test_a_grid_too_coarse_for_the_heuristic_is_caught_by_the_check(fake_dg, monkeypatch):
    monkeypatch.setattr(warmup, "M_STEP", 96)
    monkeypatch.setattr(warmup.m_grid, "__defaults__", (96,))
    report = warmup.warm_up([GemmShape("gemm", 4096, 256)], max_tokens=2000, max_rows=128, device="cpu",
                            workers=0, check=64)
    assert report.missed > 0


def test_a_shape_deep_gemm_refuses_is_reported_and_the_others_still_warm_up(fake_dg):
    shapes = [GemmShape("grouped", 96, 128, 4), GemmShape("gemm", 256, 128)]  # the stand-in refuses N = 96
    report = warmup.warm_up(shapes, max_tokens=64, max_rows=128, device="cpu", workers=1)
    assert len(report.errors) == 1 and "GemmShape(op='grouped', n=96" in report.errors[0]
    assert "AssertionError: N must be a multiple of 64" in report.errors[0]
    assert any("kernel.gemm.256.128" in p.name for p in warmup.cache_dir().iterdir())


def test_the_grouped_grid_gives_every_padded_total_once():
    from rlcli.ops.fp8.backends import padded_rows

    for groups, max_rows in ((4, 1400), (32, 5000), (1, 128), (3, 1)):
        grid = warmup.grouped_grid(max_rows, groups, 128)
        want = sorted({padded_rows(m, groups, 128) for m in range(1, max_rows + 1)})
        assert [padded_rows(m, groups, 128) for m in grid] == want


def test_warm_up_model_skips_other_backends_and_reports_for_deep_gemm(fake_dg, caplog):
    from rlcli.ops.fp8.backends import DeepGemmBackend, EmulatedBackend

    assert warmup.warm_up_model(_moe_model(EmulatedBackend()), max_tokens=64, backward=True, device="cpu") is None
    with caplog.at_level("INFO", logger="rlcli.fp8"):
        report = warmup.warm_up_model(_moe_model(DeepGemmBackend(fake_dg)), max_tokens=128, top_k=2, backward=True,
                                      device="cpu", workers=2)
    assert report.shapes == 11 and report.errors == [] and report.missed == 0 and report.compiled > 0
    assert "fp8 JIT warm-up (deep_gemm): 11 shapes" in caplog.text



def test_known_token_counts_warm_only_those_and_their_expert_rows(fake_dg, caplog):
    from rlcli.ops.fp8.backends import DeepGemmBackend

    model = _moe_model(DeepGemmBackend(fake_dg))
    with caplog.at_level("INFO", logger="rlcli.fp8"):
        report = warmup.warm_up_model(model, max_tokens=4096, top_k=2, backward=False, device="cpu", workers=0,
                                      tokens=[1000, 1000, 640])
    assert report.calls == report.shapes * 2 and report.missed == 0 and report.errors == []
    assert "token counts [640, 1000]" in caplog.text
    be = DeepGemmBackend(fake_dg, strict=True)
    before = warmup.cached_kernels()
    warmup.run_jobs([(s, [1000] if s.op == "gemm" else [2000]) for s in warmup.model_shapes(model, False)],
                    torch.device("cpu"), False)
    assert warmup.cached_kernels() == before  # the step's own M: already compiled
    jobs = dict(warmup._jobs(warmup.model_shapes(model, False), 4096, 8192, be.align, [640], None))
    assert jobs[GemmShape("gemm", 512, 256)] == [640]
    assert len(jobs[GemmShape("grouped", 128, 256, 4)]) > 1  # rows not given (expert parallelism): the grid


def test_a_token_count_below_one_is_refused():
    from rlcli.config import load_recipe
    from rlcli.config.load import ConfigError

    with pytest.raises(ConfigError, match="jit_warmup_tokens must be token counts >= 1"):
        load_recipe(None, {"train.fp8.jit_warmup_tokens": [0]})


def test_a_worker_that_writes_much_or_dies_neither_hangs_the_warm_up_nor_goes_unreported(fake_dg, monkeypatch):
    import threading

    shapes = [GemmShape("gemm", 4096, 256), GemmShape("gemm", 256, 4096)]
    monkeypatch.setenv("FAKE_DG_NOISE", "1")  # 256 KiB of stderr per compile: more than a pipe holds
    box = []
    t = threading.Thread(target=lambda: box.append(warmup.warm_up(shapes, max_tokens=256, max_rows=128,
                                                                  device="cpu", workers=2)), daemon=True)
    t.start()
    t.join(120)
    assert box and box[0].errors == [] and box[0].compiled > 0
    monkeypatch.setenv("FAKE_DG_CRASH", "1")
    report = warmup.warm_up([GemmShape("gemm", 512, 256)], max_tokens=64, max_rows=128, device="cpu", workers=1)
    assert len(report.errors) == 1 and report.errors[0].startswith("a warm-up worker exited 3")


def test_the_check_counts_no_kernel_another_warm_up_compiles_beside_it(fake_dg, tmp_path, monkeypatch):
    """rl-infer and rl-train warm up at once on one host, into one cache: a check that ran while the other
    still compiled counted the other's kernels as its own misses (3-4 on the H200, docs/benchmarks.md)."""
    import subprocess

    monkeypatch.setenv("FAKE_DG_CALL_S", "0.03")  # every call takes a while, so the two overlap
    done = tmp_path / "other-done"  # when the other's warm-up returned (its lock released)
    other = subprocess.Popen([sys.executable, "-c", "import time\nfrom rlcli.ops.fp8 import warmup\n"
                              "from rlcli.ops.fp8.warmup import GemmShape\n"
                              "warmup.warm_up([GemmShape('gemm', 4096, 512)], max_tokens=800, max_rows=128, "
                              "device='cpu', workers=0, check=0)\n"
                              f"open({str(done)!r}, 'w').write(repr(time.time()))"])
    deadline = time.monotonic() + 60
    while warmup.cached_kernels() == 0 and time.monotonic() < deadline:  # the other is sweeping
        time.sleep(0.05)
    assert other.poll() is None, "the other warm-up ended before this one started"
    report = warmup.warm_up([GemmShape("gemm", 256, 128)], max_tokens=64, max_rows=128, device="cpu", workers=0,
                            check=16)
    ended = time.time()
    assert other.wait() == 0
    assert float(done.read_text()) < ended  # this check waited for the other's sweep to end
    assert report.missed == 0 and report.compiled > 0 and report.errors == []


def test_the_cache_lock_gives_way_where_no_lock_file_can_be_made(fake_dg, tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # DG_JIT_CACHE_DIR's parent is a file: the lock file cannot be created
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(blocked / "jit"))
    with warmup.cache_lock(exclusive=True):
        pass
