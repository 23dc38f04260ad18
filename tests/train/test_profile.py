"""train.profile_step: one profiled step's collectives by kind, and its Chrome traces.

The end-to-end case is the real `rl-train --nproc-per-node 2 --ep 2 --cp 2` (torchrun, gloo)
on a tiny DeepSeek-V3-style MoE, driven by bench/trainer_node.py --smoke.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlcli.train.profile import comm_kind

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
    for rank in (0, 1):
        trace = json.loads((run / "profiles" / f"train-step{last}-rank{rank}.json").read_text())
        assert any(e.get("name") == "gloo:all_to_all" for e in trace["traceEvents"])
