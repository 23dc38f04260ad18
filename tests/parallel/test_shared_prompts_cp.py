"""Shared-prompt rows under context parallelism (real gloo group, torchrun --cp 2): a prompt
cut across the two ranks, whose completions sit on both ranks, trains to the same loss and
gradients as one process training the same samples packed unshared (dense; MoE with R3; DSA,
whose top-k then runs over the whole row's keys through the tree)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from rlcli.config.train import LossConfig
from rlcli.parallel.dims import ParallelDims
from rlcli.protocol.batch import TrainingBatch, encode_batch
from rlcli.train.loss import LOSSES
from rlcli.train.step import accumulate
from tests.train.shared_prompts import CONFIGS, make_model, make_samples, micro_batches

REPO = Path(__file__).resolve().parents[2]


def _crosses_ranks(mb) -> bool:
    """Some shared prompt holds queries of both CP ranks (rank 0: chunks 0 and 3, rank 1: 1 and 2)."""
    tree = mb.tree()
    T = tree.num_tokens + (-tree.num_tokens % 4)
    C = T // 4
    return any(s < b < e for j, (s, e) in enumerate(tree.spans) if j in tree.parents for b in (C, 3 * C))


def test_shared_prompt_split_across_cp_ranks_matches_one_process(tmp_path):
    refs = {}
    for i, (name, hf) in enumerate(CONFIGS.items()):
        model = make_model(hf, seed=20 + i, directory=tmp_path / name)
        samples = make_samples(model, seed=30 + i, prompts=(17, 6, 11), group_sizes=(3, 4, 3), r3=name != "dense")
        rows = micro_batches(samples, True, capacity=256)[0]
        assert len(rows) == 1 and _crosses_ranks(rows[0])
        batch = TrainingBatch(step=1, rank=0, micro_batches=rows, num_loss_tokens=0, num_samples=len(samples),
                              min_version=0, max_version=0)
        (tmp_path / f"batch_{name}.msgpack").write_bytes(encode_batch(batch))
        # The reference: one process, the same samples packed unshared.
        dims = ParallelDims(dp=1, cp=1, ep=1, world_size=1)
        totals, normalizer = accumulate(model, micro_batches(samples, False, capacity=256)[0], dims,
                                        torch.device("cpu"), LOSSES["icepop"], LossConfig(entropy_coef=0.01), chunk=7,
                                        r3=name != "dense")
        refs[name] = (totals["loss"] / normalizer,
                      {k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo ranks on the CPU, also where GPUs are
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(Path(__file__).with_name("dist_shared_cp.py")), str(tmp_path), ",".join(CONFIGS)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name, (ref_loss, ref_grads) in refs.items():
        got = torch.load(tmp_path / f"cp_{name}.pt")
        assert got["grads"].keys() == ref_grads.keys()
        torch.testing.assert_close(got["loss"], ref_loss, rtol=1e-5, atol=1e-6)
        for k, g in ref_grads.items():
            assert g.abs().sum() > 0, k
            torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-6, msg=k)
