"""FSDP2 training on real gloo groups (one torchrun, 2 ranks) against a single-process run.

The worker (tests/parallel/dist_worker.py) runs the trainer's pieces: meta build ->
parallelize -> per-rank slice loading -> forward/backward over its own rows (ranks hold
different numbers of rows) -> sharded publishing -> DCP checkpoint and resume. Here the
same batch is trained in one process and every number is compared.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlcli.config.train import LossConfig
from rlcli.models import ModelArgs, build_model, load_model, save_model
from rlcli.protocol.batch import Sample, TrainingBatch, build_micro_batch, encode_batch
from rlcli.train.checkpoint import load_latest_checkpoint
from rlcli.train.loss import LOSSES, token_logprobs
from rlcli.train.step import forward_backward, prepare
from rlcli.transport.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
COMMON = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6)
CONFIGS = {
    "dense": dict(COMMON, model_type="llama", tie_word_embeddings=True),
    "moe": dict(COMMON, model_type="qwen3_moe", tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
                moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1]),
}
ROWS_PER_RANK = (2, 1)  # uneven: rank 1 runs a padding pass


def _write_model(d: Path, hf: dict, seed: int) -> torch.nn.Module:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(hf))
    model = build_model(ModelArgs.from_hf(hf))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.2)
                    + (1.0 if name.endswith("norm.weight") else 0.0))
    save_model(model, d)
    return model


def _batches(model, seed: int) -> list[TrainingBatch]:
    """Rows of packed samples whose inference logprobs are the model's own, slightly perturbed
    (so the importance ratio stays inside icepop's interval and every token trains)."""
    rng = np.random.default_rng(seed)
    V = model.args.vocab_size
    out = []
    for rank, num_rows in enumerate(ROWS_PER_RANK):
        rows = []
        for _ in range(num_rows):
            samples = []
            for _ in range(3):
                n, p = int(rng.integers(6, 14)), 3
                ids = rng.integers(0, V, n).tolist()
                with torch.no_grad():
                    lp, _ = token_logprobs(model(torch.tensor([ids])), torch.tensor([ids]), 1.0)
                infer = (lp[0, p:] + torch.from_numpy(rng.normal(0, 0.05, n - p))).tolist()
                samples.append(Sample(token_ids=ids, num_prompt_tokens=p, advantage=float(rng.normal()),
                                      logprobs=infer, versions=[0] * (n - p)))
            rows.append(build_micro_batch(samples, 1.0))
        out.append(TrainingBatch(step=1, rank=rank, micro_batches=rows, num_loss_tokens=0, num_samples=0,
                                 min_version=0, max_version=0))
    return out


def _torchrun(out: Path, nproc: int, mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo ranks on the CPU, also where GPUs are
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(Path(__file__).with_name("dist_worker.py")), str(out), mode],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _inputs(out: Path) -> dict:
    refs = {}
    for i, (name, hf) in enumerate(CONFIGS.items()):
        model = _write_model(out / "models" / name, hf, seed=i)
        batches = _batches(model, seed=10 + i)
        (out / "batches" / name).mkdir(parents=True)
        for b in batches:
            (out / "batches" / name / f"{b.rank}.msgpack").write_bytes(encode_batch(b))
        refs[name] = batches
    return refs


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    refs = _inputs(out)
    _torchrun(out, 2, "fsdp")
    return out, refs


def _reference(model_dir: Path, batches: list[TrainingBatch]):
    """One process, the whole batch: loss and gradients."""
    model = load_model(model_dir)
    mbs = [mb for b in batches for mb in b.micro_batches]
    normalizer = torch.tensor(float(sum(int(mb.loss_mask.numpy().sum()) for mb in mbs)))
    loss = torch.zeros(())
    for mb in mbs:
        loss += forward_backward(model, prepare(mb, torch.device("cpu")), normalizer, LOSSES["icepop"],
                                 LossConfig(entropy_coef=0.01), chunk=1 << 20)["loss"]
    return loss / normalizer, {k: p.grad for k, p in model.named_parameters()}


def _check_step(out: Path, refs: dict, name: str, tag: str) -> None:
    ref_loss, ref_grads = _reference(out / "models" / name, refs[name])
    got = torch.load(out / f"grads_{name}_{tag}.pt")
    assert torch.allclose(got["loss"], ref_loss, rtol=1e-5, atol=1e-6), (got["loss"], ref_loss)
    assert set(got["grads"]) == set(ref_grads)
    ref_norm = torch.cat([g.flatten() for g in ref_grads.values()]).norm()
    assert torch.allclose(got["norm"], ref_norm, rtol=1e-5), (got["norm"], ref_norm)
    for k, g in ref_grads.items():
        assert g.abs().sum() > 0, k  # every parameter is trained by this batch
        assert torch.allclose(got["grads"][k], g, rtol=1e-4, atol=1e-6), (k, (got["grads"][k] - g).abs().max())


@pytest.mark.parametrize("name,ac", [("dense", "none"), ("dense", "selective"), ("dense", "full"), ("moe", "none")])
def test_fsdp_loss_and_every_gradient_match_one_process(dist_run, name, ac):
    out, refs = dist_run
    _check_step(out, refs, name, ac)


def test_reshard_per_step_matches_one_process_and_trains_like_per_micro_batch(dist_run):
    """train.parallel.reshard = "step" (gradients reduced after the last row only): the same
    gradients, and after two AdamW steps the same parameters as resharding every row (to fp32
    rounding: the sums run in another order)."""
    out, refs = dist_run
    _check_step(out, refs, "dense", "reshard_step")
    want, got = torch.load(out / "resume.pt")["step2"], torch.load(out / "reshard_step_params.pt")
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_fsdp_with_context_and_expert_parallelism_matches_one_process(tmp_path):
    """4 ranks: --dp 2 --cp 2 on the dense model, --dp 2 --cp 2 --ep 2 on the MoE, the trainer's code."""
    pytest.importorskip("rlcli.parallel.context")
    pytest.importorskip("rlcli.parallel.expert")
    refs = _inputs(tmp_path)
    _torchrun(tmp_path, 4, "epcp")
    for name in CONFIGS:
        _check_step(tmp_path, refs, name, "epcp")
        got = torch.load(tmp_path / f"grads_{name}_epcp.pt")
        for k, g in got["grads"].items():  # clipped to half the norm, on every mesh
            torch.testing.assert_close(got["clipped"][k], g / 2, rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sharded_publish_round_trips_the_loaded_slices(dist_run, name):
    out, _ = dist_run
    pub = out / f"pub_{name}" / "step_0"
    index = json.loads((pub / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # huggingface_hub's split, dealt to both ranks
    src, published = load_model(out / "models" / name), load_model(pub)
    for (k, a), (_, b) in zip(src.state_dict().items(), published.state_dict().items()):
        assert torch.equal(a, b), k


def test_dcp_resume_is_bit_identical_and_reshards_to_one_process(dist_run):
    out, _ = dist_run
    r = torch.load(out / "resume.pt")
    assert r["extra"]["step"] == 1 and r["extra"]["parallel"] == {"dp": 2, "cp": 1, "ep": 1}
    assert any(not torch.equal(r["step1"][k], r["step2"][k]) for k in r["step1"])
    for k, v in r["step2"].items():
        assert torch.equal(r["resumed"][k], v), k
        assert torch.equal(r["resumed_async"][k], v), k  # written behind step 2, it holds step 1's state
    assert r["extra_async"]["step"] == 1 and r["extra_async"]["parallel"] == {"dp": 2, "cp": 1, "ep": 1}
    # One rank's damaged shard of the newest checkpoint: every rank falls back to the one before.
    fallback = [torch.load(out / f"fallback_{rank}.pt") for rank in (0, 1)]
    assert [f["step"] for f in fallback] == [1, 1]
    for f in fallback:
        for k, v in r["step1"].items():
            assert torch.equal(f["params"][k], v), k
    # The 2-rank checkpoints into a single, unsharded process (DCP reshards on load).
    for run in ("run", "run_async"):
        model = load_model(out / "models" / "dense")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        extra = load_latest_checkpoint(RunDir(out / run), model, opt, sched)
        assert extra["step"] == 1
        for k, p in model.named_parameters():
            assert torch.equal(p.detach(), r["step1"][k]), (run, k)
