"""Run under torchrun (gloo): DSA models under context parallelism against one process.

Every rank computes the reference itself: each data rank's packed row (several documents,
longer than ``index_topk``) through the unsharded model, cross-entropy summed over the
loss tokens and divided by the global count, backward. Then ``apply_cp`` on a copy: each
rank its row's two load-balanced chunks (queries local), the latent KV and the indexer keys
all-gathered once per layer, top-k over the whole row; gradients summed over ranks (as
FSDP's reduce-scatter would). Loss and every gradient must match. Exit code 0 iff all pass.

    torchrun --nproc-per-node 2 tests/parallel/dist_dsa_cp.py
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlcli.models import ModelArgs, build_model
from rlcli.ops.attention import ForwardContext, PackedCausalAttention
from rlcli.parallel.context import all_reduce_sums, apply_cp, next_token_targets, shard_batch_for_cp

_MLA = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_topk=5, index_n_heads=4, index_head_dim=16,
            n_group=1, topk_group=1)
MODELS = {
    "deepseek_v32": dict(_MLA, model_type="deepseek_v32"),
    "glm_moe_dsa": dict(_MLA, model_type="glm_moe_dsa", indexer_types=["full", "shared", "full"]),
}
CASES = {2: [("deepseek_v32", 2, 43), ("glm_moe_dsa", 2, 40)], 4: [("glm_moe_dsa", 4, 48), ("deepseek_v32", 2, 37)]}
ATOL, RTOL = 2e-5, 1e-4


def make_row(seed: int, T: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], T
    while left:
        n = min(left, int(torch.randint(8, 25, (1,), generator=g)))
        lengths.append(n)
        left -= n
    pos = torch.cat([torch.arange(n) for n in lengths])
    mask = torch.cat([torch.arange(n) >= n // 4 for n in lengths])
    return {"input_ids": torch.randint(0, vocab, (1, T), generator=g), "position_ids": pos[None], "loss_mask": mask[None]}


def loss_sum(model, t, attn):
    logits = model(t["input_ids"], t["position_ids"], ForwardContext(attn=attn))
    ce = F.cross_entropy(logits[0].float(), t["targets"][0], reduction="none")
    return (ce * t["loss_mask"][0]).sum()


def run_case(name: str, cp: int, T: int) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // cp
    ref = build_model(ModelArgs.from_hf(MODELS[name]))
    ref.init_weights(seed=3, std=0.3)
    model = copy.deepcopy(ref)
    rows = [next_token_targets(make_row(100 + d, T, ref.args.vocab_size)) for d in range(dp)]
    num_tokens = sum(int(r["loss_mask"].sum()) for r in rows)
    ref_loss = sum(loss_sum(ref, r, PackedCausalAttention(r["position_ids"])) for r in rows)
    (ref_loss / num_tokens).backward()
    ref_loss = ref_loss.detach()

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    apply_cp(model, mesh["cp"])
    local, attn = shard_batch_for_cp(rows[rank // cp], rank % cp, cp)
    loss = loss_sum(model, local, attn)
    (loss / num_tokens).backward()
    total = all_reduce_sums({"loss": loss})["loss"]

    failures = []
    if abs(float(total) - float(ref_loss)) > ATOL * (1 + abs(float(ref_loss))):
        failures.append(f"loss {float(total)} != {float(ref_loss)}")
    ref_params, worst, checked = dict(ref.named_parameters()), 0.0, 0
    for pname, p in model.named_parameters():
        want = ref_params[pname].grad
        grad = p.grad.clone() if p.grad is not None else None
        if grad is None or want is None:
            if (grad is None) != (want is None):
                failures.append(f"grad {pname}: present on one side only")
            continue
        dist.all_reduce(grad)
        checked += 1
        worst = max(worst, (grad - want).abs().max().item())
        if not torch.allclose(grad, want, atol=ATOL, rtol=RTOL):
            failures.append(f"grad {pname}: max diff {(grad - want).abs().max().item():.2e}")
    if checked < 20 or not any("kv_a_proj" in n and ref_params[n].grad.any() for n in ref_params):
        failures.append("too few gradients compared: the case checks nothing")
    tag = f"{name} cp={cp} dp={dp} T={T} topk={ref.args.index_topk}"
    return [f"FAIL {tag}: {f}" for f in failures] or [f"ok {tag}: loss {float(ref_loss):.5f} max grad diff {worst:.1e}"]


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    lines = []
    for case in CASES[dist.get_world_size()]:
        lines += run_case(*case)
    failed = torch.tensor(sum(line.startswith("FAIL") for line in lines))
    dist.all_reduce(failed)
    if dist.get_rank() == 0 or any(line.startswith("FAIL") for line in lines):
        print("\n".join(f"[rank {dist.get_rank()}] {line}" for line in lines), flush=True)
    dist.destroy_process_group()
    return 1 if int(failed) else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
