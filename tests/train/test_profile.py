"""train.profile_step: one profiled step's collectives by kind, and its Chrome traces.

The end-to-end case is the real `rl-train --nproc-per-node 2 --ep 2 --cp 2` (torchrun, gloo)
on a tiny DeepSeek-V3-style MoE, driven by bench/trainer_node.py --smoke.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcli.train.profile import comm_kind, compile_counts

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name,kind", [
    ("ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)", "all_to_all"),
    ("gloo:all_to_all", "all_to_all"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "reduce_scatter"),
    ("gloo:all_reduce", "all_reduce"),
    ("aten::mm", None),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", None),
])
def test_collective_names_map_to_their_kind(name, kind):
    assert comm_kind(name) == kind


def test_compile_counts_see_each_recompile_and_each_eager_fallback():
    """A string argument is guarded by value: each new one compiles a new graph, until the recompile
    limit sends the frame to eager (counted once: the frame then runs eagerly without another attempt)."""
    torch._dynamo.reset()
    f = torch.compile(lambda x, s: x * len(s), backend="eager")
    seen = [compile_counts()]
    with torch._dynamo.config.patch(recompile_limit=2):
        for s in ("a", "a", "ab", "abc", "abc"):
            f(torch.ones(2), s)
            seen.append(compile_counts())
    torch._dynamo.reset()
    steps = [{k: b[k] - a[k] for k in a} for a, b in zip(seen, seen[1:])]
    assert [d["compile_graphs"] for d in steps] == [1, 0, 1, 0, 0]
    assert [d["compile_fallbacks"] for d in steps] == [0, 0, 0, 1, 0]  # past the limit: eager from then on


def _trainer_node():
    import importlib.util

    spec = importlib.util.spec_from_file_location("trainer_node", REPO / "bench" / "trainer_node.py")
    node = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(node)
    return node


def test_trainer_node_arms_compute_in_bf16_unless_told(tmp_path):
    """The GPU arms set model.dtype: the recipe default (float32) made the sixth session's H200 "bf16" arm
    an fp32 run."""
    from rlcli.config.load import load_recipe

    node = _trainer_node()
    for dtype, kw in (("bfloat16", {}), ("float32", {"dtype": "float32"})):
        recipe = node.write_run(tmp_path / dtype, node.SMOKE, 64, 8, 1, 1, 1, 1, 1, 1, 0, **kw)
        assert load_recipe(recipe).model.dtype == dtype


def test_trainer_node_dense_model_and_its_recipe_knobs(tmp_path):
    """#11's ~1B dense Llama: FLOPs per token from its own head dims (no experts, no MLA fields), and the
    knobs the bench's arms set in the recipe (checkpointing, compiled blocks, stacked FP8 siblings)."""
    from rlcli.config.load import load_recipe

    node = _trainer_node()
    flops, total, active = node.model_flops_per_token(node.LLAMA_1B, 8192)
    embed = node.LLAMA_1B["vocab_size"] * node.LLAMA_1B["hidden_size"]
    assert active == total - embed and 1.0e9 < total < 1.2e9
    attn = 6 * 16 * 16 * (128 + 128) * 8192 / 2
    assert flops == 6 * active + attn
    recipe = node.write_run(tmp_path / "r", node.SMOKE_DENSE, 64, 8, 1, 1, 1, 1, 1, 1, 0, ac="none",
                            compile_blocks=True, siblings=("qkv", "gate_up"))
    cfg = load_recipe(recipe)
    assert cfg.train.activation_checkpointing == "none" and cfg.train.compile
    assert cfg.train.fp8.fuse_siblings == ["qkv", "gate_up"]
    fused = load_recipe(node.write_run(tmp_path / "f", node.SMOKE_DENSE, 64, 8, 1, 1, 1, 1, 1, 1, 0,
                                       compile_blocks=True, graph="fused", backend="torch"))
    assert (fused.train.fp8.graph, fused.train.fp8.backend) == ("fused", "torch") and cfg.train.fp8.graph == "eager"
    out = subprocess.run([sys.executable, str(REPO / "bench" / "trainer_node.py"), "--smoke", "--model", "llama-1b"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--model llama-1b is dense: give --ep 1" in out.stderr
    bench = [sys.executable, str(REPO / "bench" / "trainer_node.py"), "--smoke"]
    out = subprocess.run(bench + ["--arms", "bf16,fp8-inline"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--arms: unknown arm 'fp8-inline'; choose from bf16, fp8," in out.stderr
    out = subprocess.run(bench + ["--compile", "--arms", "bf16,fp8-invariant"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "model.batch_invariant refuses train.compile" in out.stderr
    inv = load_recipe(node.write_run(tmp_path / "i", node.SMOKE_DENSE, 64, 8, 1, 1, 1, 1, 1, 1, 0, invariant=True))
    assert inv.model.batch_invariant and not cfg.model.batch_invariant


@pytest.mark.timeout(300)
def test_rl_train_with_ep_and_cp_records_the_profiled_steps_all_to_all(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "bench" / "trainer_node.py"), "--smoke", "--arms", "bf16",
                          "--keep", str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0 and "bf16:" in out.stdout, out.stdout + out.stderr[-3000:]
    run = tmp_path / "bf16" / "run"
    rows = [json.loads(line) for line in (run / "metrics" / "train.jsonl").read_text().splitlines()]
    last = rows[-1]["step"]
    profiled = [r for r in rows if "comm_all_to_all_s" in r]
    assert [r["step"] for r in profiled] == [last]  # only train.profile_step
    assert profiled[0]["comm_all_to_all_s"] > 0  # the experts' dispatch and combine over --ep 2
    assert profiled[0]["comm_all_gather_s"] > 0  # FSDP2 gathers, CP's K/V
    assert all(r["compile_graphs"] == 0 and r["compile_fallbacks"] == 0 for r in rows)  # nothing compiles on a CPU
    for rank in (0, 1):
        trace = json.loads((run / "profiles" / f"train-step{last}-rank{rank}.json").read_text())
        assert any(e.get("name") == "gloo:all_to_all" for e in trace["traceEvents"])
