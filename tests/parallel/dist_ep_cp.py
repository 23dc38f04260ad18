"""Run under torchrun (gloo): EP, CP and EP x CP against a single-process reference.

Every rank builds the same tiny model and computes the reference itself: the whole global
batch (every data rank's row) through the unsharded model, loss normalized by the global
loss-token count, backward. Then the parallel run: ``apply_ep`` / ``apply_cp`` on a copy,
each rank its own row (data rank = rank // cp) cut to its CP chunks, the same loss, backward,
gradients summed over the ranks that share a parameter (what FSDP's reduce-scatter does:
all ranks for dense weights, the ranks holding the same expert slice for experts). Loss,
every parameter gradient and the MoE load metrics must match. Exit code 0 iff all cases pass.

    torchrun --nproc-per-node 4 tests/parallel/dist_ep_cp.py
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

from rlcli.config.train import LossConfig
from rlcli.models import ModelArgs, build_model
from rlcli.ops.attention import ForwardContext, PackedCausalAttention, RoutingContext, doc_ids_from_positions
from rlcli.parallel.context import all_reduce_sums, apply_cp, next_token_targets, shard_batch_for_cp
from rlcli.parallel.expert import apply_ep, expert_load_metrics
from rlcli.train.loss import icepop_loss

_BASE = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0)
MODELS = {
    "llama": dict(_BASE, model_type="llama"),
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", head_dim=8, moe_intermediate_size=16, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0]),
    "deepseek_v3": dict(_BASE, model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=16,
                        n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=0,
                        n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.0),
}
# (model, ep, cp, replay recorded routes, row length, under FSDP2, activation checkpointing) per world size
CASES = {
    2: [("llama", 1, 2, False, 37), ("qwen3_moe", 2, 1, False, 40), ("qwen3_moe", 2, 2, True, 40, False, True),
        ("deepseek_v3", 2, 2, False, 43)],
    4: [("llama", 1, 4, False, 40), ("llama", 1, 2, False, 29, True), ("qwen3_moe", 4, 1, False, 40),
        ("qwen3_moe", 2, 2, True, 48), ("deepseek_v3", 4, 2, False, 40), ("qwen3_moe", 2, 2, False, 40, True)],
}
ATOL, RTOL = 2e-5, 1e-4
MODELS_VOCAB = _BASE["vocab_size"]


def make_model(name: str, **overrides):
    model = build_model(ModelArgs.from_hf({**MODELS[name], **overrides}))
    model.init_weights(seed=3, std=0.2)
    for m in model.modules():  # a routing bias that changes choices (DeepSeek)
        if getattr(m, "e_score_correction_bias", None) is not None:
            m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape,
                                                        generator=torch.Generator().manual_seed(5)) * 0.1)
    return model


def make_row(seed: int, T: int, vocab: int) -> dict[str, torch.Tensor]:
    """One packed row of several documents with prompt/completion loss masks, [1, T] tensors."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], T
    while left:
        n = min(left, int(torch.randint(4, 17, (1,), generator=g)))
        lengths.append(n)
        left -= n
    pos = torch.cat([torch.arange(n) for n in lengths])
    mask = torch.cat([torch.arange(n) >= n // 3 for n in lengths])
    return {"input_ids": torch.randint(0, vocab, (1, T), generator=g), "position_ids": pos[None],
            "loss_mask": mask[None], "advantages": (torch.randn(T, generator=g) * mask)[None],
            "inference_logprobs": (-torch.rand(T, generator=g) * 3 * mask)[None],
            "versions": torch.zeros(1, T, dtype=torch.int32), "seq_ids": doc_ids_from_positions(pos[None])}


def loss_sums(model, t, attn, routes=None):
    """Loss sum (icepop), loss-token count and logprob sum of one batch in next-token alignment."""
    routing = RoutingContext(replay=routes) if routes is not None else None
    logits = model(t["input_ids"], t["position_ids"], ForwardContext(attn=attn, routing=routing))
    lp = torch.log_softmax(logits.float(), -1).gather(-1, t["targets"][..., None])[..., 0]
    loss, _, _ = icepop_loss(lp, t["inference_logprobs"], t["advantages"], t["loss_mask"], t["seq_ids"], LossConfig())
    return loss, t["loss_mask"].sum(), (lp.detach() * t["loss_mask"]).sum()


def shard_like_the_trainer(model, mesh, ep_mesh) -> None:
    """FSDP2 as rl-train applies it: experts over "edp" of the EP mesh, blocks and root over
    all ranks, gradients summed (divide factor 1)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in model.model.layers:
        if ep_mesh is not None and hasattr(block.mlp, "experts"):
            fully_shard(block.mlp.experts, mesh=ep_mesh["edp"])
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def checkpoint_blocks(model) -> None:
    """Full activation checkpointing (non-reentrant): backward recomputes each block, hooks included."""
    from torch.utils.checkpoint import checkpoint

    for block in model.model.layers:
        forward = block.forward
        block.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)


def adamw_failures(model) -> list[str]:
    """rl-train's AdamW (``make_adamw``'s fused kernel) over the sharded parameters, the experts' on
    the EP mesh and the rest on the dense one, against torch's per-tensor AdamW from the same state."""
    from rlcli.config.train import OptimConfig
    from rlcli.train.trainer import make_adamw

    params = [p for p in model.parameters() if p.grad is not None]
    start = [p.detach().clone() for p in params]
    o = OptimConfig(lr=1e-2, weight_decay=0.1)
    make_adamw(params, o).step()
    fused = [p.detach().full_tensor() for p in params]
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                      foreach=False).step()
    plain = [p.detach().full_tensor() for p in params]
    return [f"fused AdamW moved a parameter by {(f - t).abs().max().item():.1e} more than torch's"
            for f, t in zip(fused, plain) if not torch.allclose(f, t, atol=1e-6)][:1]


def run_case(name: str, ep: int, cp: int, replay: bool, T: int, fsdp: bool = False, ac: bool = False) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // cp
    ref = make_model(name)
    rows = [next_token_targets(make_row(100 + d, T, ref.args.vocab_size)) for d in range(dp)]
    routes = []
    for row in rows:  # R3: routes recorded by a (here: the reference's own) forward, replayed by both runs
        rec = RoutingContext(record=True) if replay else None
        with torch.no_grad():
            ref(row["input_ids"], row["position_ids"], ForwardContext(PackedCausalAttention(row["position_ids"]), rec))
        routes.append(rec.stacked() if replay else None)
        if replay:
            row["routed_experts"] = routes[-1]
    for row, rt in zip(rows, routes):  # inference logprobs near the trainer's, so few tokens leave the trust interval
        with torch.no_grad():
            logits = ref(row["input_ids"], row["position_ids"],
                         ForwardContext(PackedCausalAttention(row["position_ids"]), RoutingContext(replay=rt)))
            lp = torch.log_softmax(logits, -1).gather(-1, row["targets"][..., None])[..., 0]
        noise = torch.randn(lp.shape, generator=torch.Generator().manual_seed(7)) * 0.3
        row["inference_logprobs"] = (lp + noise) * row["loss_mask"]
    num_tokens = sum(int(r["loss_mask"].sum()) for r in rows)
    expert_load_metrics(ref)  # reset the expert counters: only the measured passes below count

    model = copy.deepcopy(ref)
    ref_sums = [loss_sums(ref, r, PackedCausalAttention(r["position_ids"]), rt) for r, rt in zip(rows, routes)]
    ref_loss, ref_lp = sum(s[0] for s in ref_sums), sum(s[2] for s in ref_sums)
    (ref_loss / num_tokens).backward()
    ref_load = expert_load_metrics(ref)

    from torch.distributed.device_mesh import init_device_mesh

    world_mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    ep_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    if ep > 1:
        apply_ep(model, ep_mesh["ep"])
    if cp > 1:
        apply_cp(model, world_mesh["cp"])
    if ac:
        checkpoint_blocks(model)
    if fsdp:
        shard_like_the_trainer(model, world_mesh["dp", "cp"]._flatten("dp_cp"), ep_mesh if ep > 1 else None)
    row = rows[rank // cp]
    if cp > 1:
        local, attn = shard_batch_for_cp(row, rank % cp, cp)
    else:
        local, attn = row, PackedCausalAttention(row["position_ids"])
    loss, count, logprob = loss_sums(model, local, attn, local.get("routed_experts"))
    (loss / num_tokens).backward()
    totals = all_reduce_sums({"loss": loss, "count": count, "logprob": logprob})
    load = expert_load_metrics(model, group=dist.group.WORLD)

    failures = []
    if float(ref_loss) == 0 or sum(p.grad is not None and bool(p.grad.any()) for p in ref.parameters()) < 10:
        failures.append("the reference has no loss or no gradients: the case checks nothing")
    ref_loss = ref_loss.detach()
    if abs(float(totals["loss"]) - float(ref_loss)) > ATOL * (1 + abs(float(ref_loss))):
        failures.append(f"loss {float(totals['loss'])} != {float(ref_loss)}")
    if abs(float(totals["logprob"]) - float(ref_lp)) > ATOL * (1 + abs(float(ref_lp))):
        failures.append(f"logprob sum {float(totals['logprob'])} != {float(ref_lp)}")
    if int(totals["count"]) != num_tokens:
        failures.append(f"loss tokens {int(totals['count'])} != {num_tokens}")
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for pname, p in model.named_parameters():
        expert = pname.endswith(("w_gate", "w_up", "w_down")) and ep > 1
        want = ref_params[pname].grad
        if want is None:
            want = torch.zeros_like(ref_params[pname])
        if fsdp:  # FSDP already summed the gradients over the ranks that share each parameter
            grad = p.grad.full_tensor()
        else:  # sum them as FSDP would: dense over all ranks, experts over the ranks with the same slice
            grad = p.grad.to_local() if expert else p.grad
            grad = grad.clone() if grad is not None else torch.zeros_like(want)
            dist.all_reduce(grad, group=ep_mesh["edp"].get_group() if expert else None)
            if expert:
                owner = model.get_submodule(pname.rsplit(".", 1)[0])
                want = want[owner.expert_offset:owner.expert_offset + owner.num_experts]
        if grad.shape != want.shape or not torch.allclose(grad, want, atol=ATOL, rtol=RTOL):
            failures.append(f"grad {pname}: max diff {(grad - want).abs().max().item() if grad.shape == want.shape else 'shape'}")
        worst = max(worst, (grad - want).abs().max().item() if grad.shape == want.shape else float("inf"))
    if fsdp:
        failures += adamw_failures(model)
    if T % (2 * cp) == 0:  # padding tokens would add to the expert counts
        for key, value in ref_load.items():
            if abs(float(load[key]) - float(value)) > 1e-5:
                failures.append(f"{key} {float(load[key])} != {float(value)}")
    tag = f"{name} ep={ep} cp={cp} dp={dp} replay={replay} T={T}{' fsdp' if fsdp else ''}{' ac' if ac else ''}"
    return [f"FAIL {tag}: {f}" for f in failures] or [f"ok {tag}: loss {float(ref_loss):+.5f} logprob {float(ref_lp):+.4f} max grad diff {worst:.1e}"]


def run_invariant_case(name: str) -> list[str]:
    """model.batch_invariant under expert parallelism (ep = world): each rank's row gives the logits of
    the single-process model under the flag bit for bit, though its experts now also compute the
    other ranks' tokens. The same comparison without the flag is reported, not required. Experts 32
    wide: at 16, fp32 SiLU's scalar tail loop took some rows (rlcli.ops.batch_invariant's caveat)."""
    from rlcli.ops.batch_invariant import enable, make_batch_invariant

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [make_row(200 + d, 41, MODELS_VOCAB) for d in range(world)]
    ep_mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    equal = {}
    for flag in (True, False):
        enable(flag)
        ref = make_model(name, moe_intermediate_size=32)
        if flag:
            make_batch_invariant(ref)
        model = copy.deepcopy(ref)
        apply_ep(model, ep_mesh["ep"])
        backend = "invariant" if flag else "sdpa"
        row = rows[rank]
        with torch.no_grad():
            want = ref(row["input_ids"], row["position_ids"],
                       ForwardContext(PackedCausalAttention(row["position_ids"], backend=backend)))
            got = model(row["input_ids"], row["position_ids"],
                        ForwardContext(PackedCausalAttention(row["position_ids"], backend=backend)))
        equal[flag] = torch.equal(got, want)
    enable(False)
    tag = f"{name} ep={world} batch_invariant"
    if not equal[True]:
        return [f"FAIL {tag}: the EP logits differ from the single process's under the flag"]
    return [f"ok {tag}: logits bit for bit (without the flag: {'equal' if equal[False] else 'not equal'})"]


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    lines = []
    for case in CASES[dist.get_world_size()]:
        lines += run_case(*case)
    for name in ("qwen3_moe", "deepseek_v3"):
        lines += run_invariant_case(name)
    failed = torch.tensor(sum(line.startswith("FAIL") for line in lines))
    dist.all_reduce(failed)
    if dist.get_rank() == 0 or any(line.startswith("FAIL") for line in lines):
        print("\n".join(f"[rank {dist.get_rank()}] {line}" for line in lines), flush=True)
    dist.destroy_process_group()
    return 1 if int(failed) else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
