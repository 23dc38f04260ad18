"""The longest sequence one training step fits with context parallelism, against no CP.

Run under torchrun with 2 processes (two GPUs). The model is the Llama-3.2-1B shape with
random weights, bf16 compute with fp32 master weights (FSDP2 over both ranks), full
activation checkpointing per block, logprobs over the 128k vocabulary in token chunks
(never the whole row's logits). For each row length (doubling from --start up to
--max), one step is tried twice, side by side:

* ``cp=2``: the row is split over the two ranks (causal load balancing, K/V all-gathered
  once per layer, ``rlcli.parallel.context``), attention by the document-mask backend
  (FlexAttention under CP on CUDA);
* ``cp=1``: each rank trains the whole row alone (the baseline: plain data parallelism).

A step that runs out of memory is reported as OOM. Prints per length and mode: step
seconds, tokens/s (of the row), peak GiB; then the longest length that fit per mode and
their ratio.

    torchrun --standalone --nproc-per-node 2 bench/cp_longest_sequence.py            # 2 GPUs
    torchrun --standalone --nproc-per-node 2 bench/cp_longest_sequence.py --smoke    # CPU, gloo, tiny
    torchrun --standalone --nproc-per-node 2 bench/cp_longest_sequence.py --model dsa   # DSA (2 GPUs)
"""

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlcli.models.config import ModelArgs  # noqa: E402
from rlcli.models.hf_io import build_model  # noqa: E402
from rlcli.ops.attention import ForwardContext, PackedCausalAttention  # noqa: E402
from rlcli.parallel.context import apply_cp, next_token_targets, shard_batch_for_cp  # noqa: E402

LLAMA_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                rope_theta=500000.0, max_position_embeddings=262144, tie_word_embeddings=True, rms_norm_eps=1e-5)
SMOKE = dict(LLAMA_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def build(cfg: dict, cp: int, mesh, device, compute_dtype):
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    model = build_model(ModelArgs.from_hf(cfg), materialize=False)  # meta, fp32 master weights
    if cp > 1:
        apply_cp(model, mesh)
    for block in model.model.layers:
        block.forward = _checkpointed(block.forward)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    from torch.distributed.fsdp import register_fsdp_forward_method
    register_fsdp_forward_method(model, "hidden_states")
    model.to_empty(device=device)
    model.init_buffers()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model


def _checkpointed(forward):
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def chunked_loss(h_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor, mask_T: torch.Tensor,
                 chunk: int) -> torch.Tensor:
    """Sum of masked target logprobs, logits computed (and recomputed in backward) per chunk."""
    def piece(h, t, m):
        lp = torch.log_softmax((h @ w_VD.T).float(), -1).gather(-1, t[:, None])[:, 0]
        return (lp * m).sum()
    total = h_TD.new_zeros((), dtype=torch.float32)
    for s in range(0, h_TD.shape[0], chunk):
        total = total + checkpoint(piece, h_TD[s:s + chunk], targets_T[s:s + chunk], mask_T[s:s + chunk],
                                   use_reentrant=False)
    return total


def one_step(model, opt, T: int, cp: int, rank: int, device, chunk: int, backend: str) -> float:
    gen = torch.Generator().manual_seed(T)
    t = {"input_ids": torch.randint(0, model.args.vocab_size, (1, T), generator=gen),
         "position_ids": torch.arange(T)[None], "loss_mask": torch.ones(1, T, dtype=torch.bool)}
    host_pos = t["position_ids"]
    t = {k: v.to(device) for k, v in next_token_targets(t).items()}
    if cp > 1:
        t, attn = shard_batch_for_cp(t, rank, cp, backend=backend, host_position_ids=host_pos)
    else:
        attn = PackedCausalAttention(host_pos, backend=backend, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    h = model.hidden_states(t["input_ids"], t["position_ids"], ForwardContext(attn=attn))
    loss = -chunked_loss(h[0], model.lm_head.weight, t["targets"][0], t["loss_mask"][0].float(), chunk) / T
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo)")
    # --from-len/--to-len: torchrun's own parser takes --start/--max as prefixes of its options
    ap.add_argument("--start", "--from-len", dest="start", type=int, default=32768)
    ap.add_argument("--max", "--to-len", dest="max", type=int, default=262144)
    ap.add_argument("--only-cp2", action="store_true", help="skip the cp=1 side (a short run)")
    ap.add_argument("--chunk", type=int, default=4096, help="tokens per logprob chunk")
    ap.add_argument("--attn", default="auto", choices=["auto", "sdpa", "flex", "varlen"])
    ap.add_argument("--model", default="llama-1b", choices=["llama-1b", "dsa"],
                    help="dsa: the small DeepSeek-V3.2-shaped model of bench/dsa_attention.py (sparse attention)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # A bounded timeout: should one rank run out of memory inside a collective, the other fails soon.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=240))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run with torchrun --nproc-per-node 2"
    from torch.distributed.device_mesh import init_device_mesh

    cfg, compute_dtype = (SMOKE, torch.float32) if a.smoke else (LLAMA_1B, torch.bfloat16)
    if a.model == "dsa":
        from bench.dsa_attention import SMALL, SMOKE as DSA_SMOKE
        from rlcli.ops import mla
        cfg = DSA_SMOKE if a.smoke else SMALL
        if cuda:
            mla.CUDA_CHUNK_ELEMENTS = 1 << 30  # as measured at 131k on two H200s
    if a.smoke:
        torch.set_num_threads(1)
        a.start, a.max, a.chunk = 64, 256, 32
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_cp",))
    rows, longest = [], {}
    for cp in (2,) if a.only_cp2 else (2, 1):
        model = build(cfg, cp, mesh, device, compute_dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        T = a.start
        while T <= a.max:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                dt = one_step(model, opt, T, cp, rank, device, a.chunk, a.attn)
                ok = torch.tensor(1, device=device)
            except torch.OutOfMemoryError:
                dt, ok = float("nan"), torch.tensor(0, device=device)
                opt.zero_grad(set_to_none=True)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            fit = bool(ok.item())
            rows.append((cp, T, dt, peak, fit))
            if rank == 0:
                print(f"cp={cp} seq {T}: {'trained in %.2f s, peak %.1f GiB' % (dt, peak) if fit else 'OOM'}",
                      flush=True)
            if not fit:
                break
            longest[cp] = T
            T *= 2
        del model, opt
    if rank == 0:
        name = torch.cuda.get_device_name() if cuda else "cpu"
        shape = "smoke" if a.smoke else ("small DSA model" if a.model == "dsa" else "Llama-3.2-1B shape")
        print(f"device {name} x{world}, torch {torch.__version__}, {shape}, "
              f"full activation checkpointing, attention backend {a.attn}")
        print(f"{'mode':<6} {'seq':>8} {'step s':>8} {'tokens/s':>10} {'peak GiB':>9}")
        for cp, T, dt, peak, fit in rows:
            print(f"cp={cp:<4} {T:>8} {dt:>8.2f} {T / dt if fit else 0:>10.0f} {peak:>9.1f}{'' if fit else '  OOM'}")
        if a.only_cp2:
            print(f"longest trained sequence: cp=2 {longest.get(2, 0)} (cp=1 not run)")
        else:
            print(f"longest trained sequence: cp=2 {longest.get(2, 0)}, cp=1 {longest.get(1, 0)} "
                  f"(ratio {longest.get(2, 0) / max(longest.get(1, 1), 1):.1f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
