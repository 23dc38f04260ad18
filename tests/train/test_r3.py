"""R3 in the trainer: packed batches carry the engine's routes to the right tokens, the MoE
layers use exactly those experts, gradients still reach the router, and routes that do not
fit the model (or a trainer whose r3 disagrees with the batch) are refused."""

import json

import numpy as np
import pytest
import torch

from rlcli.config.train import LossConfig
from rlcli.errors import ConfigError
from rlcli.models import load_model
from rlcli.models.moe import MoE
from rlcli.ops.attention import ForwardContext, PackedCausalAttention, RoutingContext
from rlcli.protocol import WireTensor
from rlcli.protocol.batch import Sample, build_micro_batch, pack_rows
from rlcli.train.loss import LOSSES
from rlcli.train.step import forward_backward, prepare

NUM_EXPERTS, TOP_K, NUM_MOE_LAYERS = 8, 2, 2


@pytest.fixture
def moe(tmp_path):
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64,
           "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": NUM_EXPERTS,
           "num_experts_per_tok": TOP_K, "norm_topk_prob": True, "mlp_only_layers": [1]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(tmp_path, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


class trainer_for:
    """rl-train's step code path (rlcli.train.step), without run directory, sockets or process group."""

    def __init__(self, model, r3: bool):
        self.model, self.r3 = model, r3

    def forward_backward(self, mb, num_loss_tokens: int) -> dict:
        return forward_backward(self.model, prepare(mb, torch.device("cpu")), torch.tensor(float(num_loss_tokens)),
                                LOSSES["tis"], LossConfig(), 1024, r3=self.r3)


def samples(rng: np.random.Generator, lengths=(7, 12, 5, 9)) -> list[Sample]:
    out = []
    for n in lengths:
        routes = np.stack([rng.permutation(NUM_EXPERTS)[:TOP_K] for _ in range((n - 1) * NUM_MOE_LAYERS)])
        out.append(Sample(token_ids=rng.integers(0, 64, n).tolist(), num_prompt_tokens=3, advantage=1.0,
                          logprobs=[-1.0] * (n - 3), versions=[0] * (n - 3),
                          routed_experts=WireTensor.from_numpy(
                              routes.reshape(n - 1, NUM_MOE_LAYERS, TOP_K).astype(np.int16))))
    return out


def capture_experts(model) -> list[torch.Tensor]:
    """The expert ids each MoE layer sends its tokens to ([N, top_k] per layer, in forward order)."""
    seen: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, MoE):
            def routed(x_ND, idx_Nk, gates_Nk, _inner=m.routed):
                seen.append(idx_Nk.clone())
                return _inner(x_ND, idx_Nk, gates_Nk)
            m.routed = routed
    return seen


def test_packed_routes_reach_the_moe_layers_token_by_token(moe):
    rng = np.random.default_rng(0)
    ss = samples(rng)
    row = pack_rows([len(s.token_ids) for s in ss], capacity=64)[0]  # first-fit decreasing reorders them
    assert row != sorted(row)
    mb = build_micro_batch([ss[i] for i in row], temperature=1.0)
    seen = capture_experts(moe)
    metrics = trainer_for(moe, r3=True).forward_backward(mb, num_loss_tokens=20)
    assert len(seen) == NUM_MOE_LAYERS
    for layer, idx in enumerate(seen):
        expected = []
        for i in row:
            r = ss[i].routed_experts.numpy()[:, layer]
            expected.append(np.concatenate([r, r[-1:]]))  # the last token's (unused) route repeats
        assert (idx.numpy() == np.concatenate(expected)).all()
    # Gradients still reach every router through the gate values of the replayed experts.
    routers = [m.gate.weight for m in moe.modules() if hasattr(m, "gate") and hasattr(m.gate, "weight")]
    assert len(routers) == NUM_MOE_LAYERS and all(w.grad is not None and w.grad.abs().sum() > 0 for w in routers)
    # Random routes: the router would mostly pick others.
    assert metrics["router_pairs"].item() == NUM_MOE_LAYERS * (mb.input_ids.numpy().size - len(row))
    assert metrics["router_disagree"].item() > 0.5 * metrics["router_pairs"].item()


def test_router_disagreement_is_counted_through_fsdp2(moe, tmp_path):
    """FSDP2 rebuilds the dataclasses among a layer's inputs as it moves and casts them, so each
    sharded layer saw a copy of the routing context: with more than one trainer rank (any of dp,
    cp, ep) rl-train reported a router disagreement of exactly 0 whatever the routes (the loop on
    the CPU: 0.0000 at 2 ranks, 0.0097 at 1, same batches). rl-train's FSDP2 wrap, one gloo rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlcli.parallel.fsdp import apply_fsdp

    rng = np.random.default_rng(0)
    ss = samples(rng)
    mb = build_micro_batch(ss, temperature=1.0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        apply_fsdp(moe, init_device_mesh("cpu", (1,)), torch.float32)  # as rl-train wraps its model
        metrics = trainer_for(moe, r3=True).forward_backward(mb, num_loss_tokens=20)
    finally:
        dist.destroy_process_group()
    assert metrics["router_pairs"].item() == NUM_MOE_LAYERS * (mb.input_ids.numpy().size - len(ss))
    assert metrics["router_disagree"].item() > 0.5 * metrics["router_pairs"].item()  # random routes


def test_router_disagreement_is_zero_when_replaying_its_own_routes(moe):
    rng = np.random.default_rng(1)
    s = samples(rng, lengths=(10,))[0]
    ids = torch.tensor([s.token_ids])
    pos = torch.arange(ids.shape[1])[None]
    ctx = ForwardContext(attn=PackedCausalAttention(pos), routing=RoutingContext(record=True))
    with torch.no_grad():
        moe(ids, pos, ctx)
    s.routed_experts = WireTensor.from_numpy(ctx.routing.stacked()[:-1].numpy().astype(np.int16))
    metrics = trainer_for(moe, r3=True).forward_backward(build_micro_batch([s], 1.0), num_loss_tokens=7)
    assert metrics["router_disagree"].item() == 0


def test_routes_of_another_shape_are_refused(moe):
    rng = np.random.default_rng(2)
    s = samples(rng, lengths=(6,))[0]
    bad = s.routed_experts.numpy()[:, :1]  # one MoE layer recorded, the model has two
    s.routed_experts = WireTensor.from_numpy(np.ascontiguousarray(bad))
    with pytest.raises(ValueError, match="shape"):
        trainer_for(moe, r3=True).forward_backward(build_micro_batch([s], 1.0), num_loss_tokens=3)
    s = samples(rng, lengths=(6,))[0]
    s.routed_experts = WireTensor.from_numpy(np.full((5, NUM_MOE_LAYERS, TOP_K), NUM_EXPERTS, dtype=np.int16))
    with pytest.raises(ValueError, match="experts outside"):
        trainer_for(moe, r3=True).forward_backward(build_micro_batch([s], 1.0), num_loss_tokens=3)


def test_r3_mismatch_between_orchestrator_and_trainer_is_a_config_error(moe):
    rng = np.random.default_rng(3)
    with pytest.raises(ConfigError, match="r3 = true"):
        trainer_for(moe, r3=False).forward_backward(build_micro_batch(samples(rng), 1.0), num_loss_tokens=20)
    plain = [Sample(token_ids=s.token_ids, num_prompt_tokens=3, advantage=1.0, logprobs=s.logprobs,
                    versions=s.versions) for s in samples(rng)]
    with pytest.raises(ConfigError, match="no routes"):
        trainer_for(moe, r3=True).forward_backward(build_micro_batch(plain, 1.0), num_loss_tokens=20)


def _padding_run(tmp_path, cp: int, scenarios: dict) -> dict:
    """The padding worker under torchrun: 2 data-parallel ranks x ``cp``; each scenario's rows per
    data-parallel rank. Returns {(scenario, rank): that rank's metric sums}."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from rlcli.protocol.batch import TrainingBatch, encode_batch

    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64,
           "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": NUM_EXPERTS,
           "num_experts_per_tok": TOP_K, "norm_topk_prob": True, "mlp_only_layers": [1]}
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
    for scenario, rows in scenarios.items():
        (tmp_path / "batches" / scenario).mkdir(parents=True)
        for rank, mbs in enumerate(rows):
            batch = TrainingBatch(step=1, rank=rank, micro_batches=mbs, num_loss_tokens=0, num_samples=0,
                                  min_version=0, max_version=0)
            (tmp_path / "batches" / scenario / f"{rank}.msgpack").write_bytes(encode_batch(batch))
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(2 * cp), str(Path(__file__).with_name("r3_padding_worker.py")), str(tmp_path),
                          str(tmp_path / "model"), str(cp)],
                         env={**os.environ,
                              "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
                              "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},  # gloo ranks on the CPU
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return {(s, r): torch.load(tmp_path / f"{s}_{r}.pt") for s in scenarios for r in range(2 * cp)}


def test_a_rank_with_fewer_rows_pads_under_r3(tmp_path):
    """Two data-parallel ranks (gloo): rank 0 holds two rows, rank 1 one or none. A rank with no
    row pads with a filler that carries no routes; under r3 it was refused ("no routes"), so a
    step whose rows all fit on rank 0 ended rl-train. Now its padding pass replays filler routes and
    reports the same metric keys; a padding pass counts no route (it counted its row's again)."""
    rng = np.random.default_rng(4)
    a, b, c = (build_micro_batch(samples(rng), 1.0) for _ in range(3))
    got = _padding_run(tmp_path, 1, {"empty": ([a, b], []), "fewer": ([a, b], [c])})
    for s in ("empty", "fewer"):
        assert got[s, 0].keys() == got[s, 1].keys() and "router_pairs" in got[s, 1]
    assert got["empty", 1]["router_pairs"].item() == 0 and got["empty", 1]["loss"].item() == 0
    one_row = trainer_for(load_model(tmp_path / "model", seed=3), r3=True).forward_backward(c, num_loss_tokens=20)
    assert got["fewer", 1]["router_pairs"].item() == one_row["router_pairs"].item() > 0


def test_a_context_parallel_pair_with_no_row_pads_with_a_row_it_can_split(tmp_path):
    """2 data-parallel x 2 context-parallel ranks: the pair of data-parallel rank 1 holds no row. Its
    filler had 2 tokens, and --cp 2 cuts a row into 4 chunks: rl-train stopped on the padding pass
    ("a row holds only 2 tokens"). The filler now has 2 x cp tokens; the pair pads alike."""
    rng = np.random.default_rng(5)
    a, b = (build_micro_batch(samples(rng), 1.0) for _ in range(2))
    got = _padding_run(tmp_path, 2, {"empty": ([a, b], [])})
    assert all(got["empty", r].keys() == got["empty", 0].keys() for r in range(4))
    assert all(got["empty", r]["router_pairs"].item() == 0 and got["empty", r]["loss"].item() == 0 for r in (2, 3))
