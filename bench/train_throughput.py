"""rl-train step throughput on a GPU: tokens/s, MFU and peak memory of the trainer's own step.

The step is the trainer's: the model built on the meta device, ``rlcli.parallel``'s FSDP2
(fp32 master weights, bf16 compute, fp32 gradient reduction, also on one GPU), hidden
states -> chunked logprobs (``rlcli.ops.logprobs``) -> a policy-gradient loss -> AdamW.
Random weights and tokens; a row is one --seq-token document (two with the sweep's +pack2),
attended with the kernel of --attention (train.attention).

Modes (each prints a table last):
  dense    Llama-3.2-1B shape at --seq tokens: tokens/s, MFU, peak memory; --attention, --adamw,
           --reshard, --chunk, --no-fsdp pick the trainer's options (train.attention,
           train.optim.implementation, train.parallel.reshard, train.logprob_chunk_tokens; no
           FSDP = what rl-train does at one rank: bf16 parameters, no fp32 masters)
  sweep    dense under the trainer's levers (--arms, in order), greedily: each is tried on the best
           configuration so far and kept if tokens/s rises; a row per arm as it finishes, one table,
           then the rl-train flags of the best
  moe      Qwen3-MoE-style ~2B total: tokens/s with the stacked-expert loop (rlcli.models.moe,
           the baseline) vs one grouped GEMM per projection (torch._grouped_mm) side by side
  dp       runs this script under torchrun with 1 and with 2 processes (FSDP2, --dp 2) and
           prints the 2-GPU / 1-GPU throughput ratio
  cp       the longest sequence one step trains with --cp 2 (needs rlcli.parallel.context)

MFU = model FLOPs / (seconds * peak), model FLOPs per step = 6 * N * tokens
+ 12 * L * d * seq * tokens / 2 (causal attention: half of the 12*L*d*seq of full attention),
N = parameters that take part in a matmul (the input embedding table is a lookup: it is
left out unless tied to the LM head), L layers, d = heads * head_dim. Peak = --peak-tflops
(H200 SXM dense bf16: 989). Imports only torch, safetensors and rlcli's models/ops/parallel
(no msgspec or zmq). --smoke runs everything tiny on the CPU (gloo).
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlcli.models.config import ModelArgs  # noqa: E402
from rlcli.models.hf_io import build_model  # noqa: E402
from rlcli.ops.attention import ForwardContext, PackedCausalAttention  # noqa: E402
from rlcli.ops.logprobs import chunked_logprobs  # noqa: E402
from rlcli.parallel.fsdp import (apply_activation_checkpointing, apply_compile, apply_fsdp,  # noqa: E402
                                 sync_gradients_on)

LLAMA_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5)
QWEN3_MOE_2B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                    num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                    rope_theta=1000000.0, max_position_embeddings=131072, tie_word_embeddings=False)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


# ------------------------------------------------------------------ grouped-GEMM experts (side by side)

def grouped_experts_forward(self, x_ND, idx_Nk, gates_Nk):
    """The stacked experts as three torch._grouped_mm calls, no host sync: token rows sorted by
    expert, each expert's group padded to a multiple of 16 rows at offsets computed on device."""
    N, k = idx_Nk.shape
    E, align = self.num_experts, 16
    flat = idx_Nk.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    starts_padded, starts = ends - padded, counts.cumsum(0) - counts
    e_sorted = flat[order]
    dest = starts_padded[e_sorted] + torch.arange(N * k, device=x_ND.device) - starts[e_sorted]
    rows = N * k + E * (align - 1)
    x = x_ND.new_zeros(rows, x_ND.shape[1])
    x[dest] = x_ND[order // k]
    offs = ends.to(torch.int32)
    h = F.silu(torch._grouped_mm(x, self.w_gate.transpose(-2, -1), offs=offs)) * \
        torch._grouped_mm(x, self.w_up.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(h, self.w_down.transpose(-2, -1), offs=offs)[dest]
    y = y * gates_Nk.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x_ND).index_add_(0, order // k, y.to(x_ND.dtype))


def select_experts(model: torch.nn.Module, experts: str) -> None:
    """"loop": one matmul per expert; "grouped": one grouped GEMM per projection. With
    rlcli.ops.grouped_gemm (the model's own grouped GEMM) the loop is its reference path;
    without it the model loops and the grouped path is :func:`grouped_experts_forward`."""
    try:
        from rlcli.ops import grouped_gemm
    except ImportError:
        grouped_gemm = None
    if grouped_gemm is not None:
        grouped_gemm._works.clear()
        if experts == "loop":
            for key in [("cuda", torch.bfloat16), ("cuda", torch.float32), ("cpu", torch.float32)]:
                grouped_gemm._works[key] = False
        return
    if experts == "grouped":
        from rlcli.models.moe import GroupedExperts

        for m in model.modules():
            if isinstance(m, GroupedExperts):
                m.forward = grouped_experts_forward.__get__(m)


# ------------------------------------------------------------------ one configuration

@dataclasses.dataclass
class Arm:
    """The trainer options one dense run uses (names as in rl-train's config)."""

    name: str = "dense"
    compile: bool = False  # train.compile
    attention: str = "varlen"  # train.attention (its auto now picks cudnn for these one-document rows)
    adamw: str = "foreach"  # train.optim.implementation
    reshard: str = "micro_batch"  # train.parallel.reshard
    chunk: int = 2048  # train.logprob_chunk_tokens
    fsdp: bool = True  # False: rl-train's one-rank path (bf16 parameters, no FSDP2, no fp32 masters)
    keep_logits: bool = False  # train.logprob_keep_logits
    docs_per_row: int = 1  # documents of --seq tokens packed per row (train.micro_batch_tokens / seq)


# The sweep is greedy: it starts from the compiled step (--compile's arm) and tries each lever in
# turn on the best configuration so far, keeping it when tokens/s rises. Report-only arms are
# measured on the best configuration but never kept.
LEVERS = {
    "compiled": {},
    "+cudnn": {"attention": "cudnn"},
    "+fused": {"adamw": "fused"},
    "+reshard_step": {"reshard": "step"},
    "+chunk8k": {"chunk": 8192},
    "+keep_logits": {"keep_logits": True},
    "+pack2": {"docs_per_row": 2, "chunk": 16384},
    "flex": {"attention": "flex"},
    "varlen": {"attention": "varlen"},
    "sdpa": {"attention": "sdpa"},
    "no_fsdp_bf16": {"fsdp": False, "reshard": "micro_batch"},  # rl-train at one rank: no fp32 masters
    "eager": {"compile": False},
}
REPORT_ONLY = {"no_fsdp_bf16", "eager"}
DEFAULT_ARMS = "compiled,+cudnn,+fused,+reshard_step,+chunk8k,+keep_logits,+pack2,no_fsdp_bf16"


def setup_dist(device_type: str) -> tuple[int, int]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def flops_per_token(args: ModelArgs, model: torch.nn.Module, seq: int) -> float:
    n = sum(p.numel() for p in model.parameters())
    if not args.tie_word_embeddings:
        n -= args.vocab_size * args.hidden_size
    if args.is_moe:  # only top_k of num_experts experts run per token
        expert = 3 * args.hidden_size * args.moe_intermediate_size
        n -= len(args.moe_layers) * expert * (args.num_experts - args.num_experts_per_tok)
    attn = 12 * args.num_hidden_layers * args.num_attention_heads * args.head_dim * seq / 2
    return 6 * n + attn


def run_config(hf: dict, seq: int, rows: int, steps: int, warmup: int, device: torch.device, ac: str,
               experts: str = "loop", cp: int = 1, arm: Arm = Arm(), profile: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    args = ModelArgs.from_hf(hf)
    cuda = device.type == "cuda"
    master = torch.float32 if arm.fsdp or not cuda else torch.bfloat16
    model = build_model(args, device="meta", dtype=master, materialize=False)
    select_experts(model, experts)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_cp",))
    apply_activation_checkpointing(model, ac)
    if arm.compile:
        apply_compile(model)
    if arm.fsdp:
        apply_fsdp(model, mesh, torch.bfloat16 if cuda else torch.float32, reshard=arm.reshard)
    model.to_empty(device=device)
    if not arm.fsdp:
        model.tie_weights()
    model.init_buffers()
    with torch.no_grad():  # random init of each rank's own shards (DTensor locals)
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.fill_(1.0) if name.endswith("norm.weight") else local.normal_(0.0, 0.02)
    extra = {"fused": True} if arm.adamw == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **extra)
    gen = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    # A row packs docs_per_row documents of seq tokens (rows counts documents; the trainer's
    # train.micro_batch_tokens = docs_per_row * seq).
    if rows % arm.docs_per_row:
        raise ValueError(f"--rows {rows} is not a multiple of {arm.docs_per_row} documents per row")
    n_rows, row_len = rows // arm.docs_per_row, seq * arm.docs_per_row
    ids = torch.randint(0, args.vocab_size, (n_rows, 1, row_len), generator=gen).to(device)
    host_pos = torch.arange(seq).repeat(arm.docs_per_row)[None]  # document boundaries are read from the host copy
    pos = host_pos.to(device)
    adv = torch.randn(n_rows, row_len, generator=gen).to(device)

    def step():
        for r in range(n_rows):
            if arm.reshard == "step":
                sync_gradients_on(model, last=r == n_rows - 1)
            ctx = ForwardContext(attn=PackedCausalAttention(host_pos, backend=arm.attention, device=device))
            h = model.hidden_states(ids[r], pos, ctx)[0]
            lp, _ = chunked_logprobs(h[:-1], model.lm_head.weight, ids[r, 0, 1:], 1.0, arm.chunk,
                                     keep_logits=arm.keep_logits)
            (-(lp.exp() * adv[r, 1:]).sum() / (rows * seq)).backward()  # (one target crosses documents: a bench)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    sync()
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    graphs = counters["stats"]["unique_graphs"] - graphs  # compiled inside the timing: should be 0
    if profile and dist.get_rank() == 0:
        from torch.profiler import ProfilerActivity, profile as prof

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with prof(activities=acts) as p:
            step()
            sync()
        keys = ["self_device_time_total", "self_cuda_time_total"] if cuda else ["self_cpu_time_total"]
        for key in keys:
            try:
                print(p.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60), file=sys.stderr)
                break
            except (AttributeError, KeyError, ValueError, RuntimeError):
                continue
    tokens = rows * seq * world
    out = {"tokens_per_s": tokens / dt, "step_s": dt, "flops_per_token": flops_per_token(args, model, seq),
           "params": sum(p.numel() for p in model.parameters()), "world": world, "graphs_in_timing": graphs}
    out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    del model, opt, step
    if arm.compile:
        from rlcli.ops.logprobs import use_compiled

        use_compiled(False)  # the next configuration runs eager
        torch._dynamo.reset()  # and compiles its own graphs (the inductor cache keeps recompiles short)
    release_memory(cuda)
    return out


def release_memory(cuda: bool) -> None:
    """Free what a finished configuration held (FSDP2 state and compiled code form cycles)."""
    import gc

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def attention_report(device: torch.device, hf: dict, seq: int) -> str:
    """Which fused attention kernels this torch offers for one 8k document of the model's heads."""
    if device.type != "cuda":
        return "attention kernels: cpu"
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention

    H, Hkv, D = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    q = torch.empty(1, seq, H, D, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.empty(1, seq, Hkv, D, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    params = SDPAParams(q, k, k, None, 0.0, True, True)
    out = [f"cudnn {torch.backends.cudnn.version()}", f"cudnn_sdpa(gqa)={can_use_cudnn_attention(params)}",
           f"flash_sdpa(gqa)={can_use_flash_attention(params)}"]
    try:
        from torch.nn.attention import activate_flash_attention_impl, list_flash_attention_impls

        out.append(f"flash impls {list_flash_attention_impls()}")
        try:
            activate_flash_attention_impl("FA3")
            out.append("FA3 active (varlen and flash SDPA run FA3)")
        except Exception as e:  # noqa: BLE001 - report why, keep FA2
            out.append(f"FA3 unavailable ({type(e).__name__}: {str(e)[:60]})")
    except ImportError:
        out.append("no flash-impl switch in this torch")
    return "attention kernels: " + ", ".join(out)


def attention_kernels(device: torch.device, hf: dict, seq: int, backends: list[str], iters: int = 10) -> str:
    """One layer's attention over one --seq document, forward + backward, through
    PackedCausalAttention with each backend: ms, TFLOP/s (causal: 2 * 2 * seq^2 / 2 * H * D per
    direction, backward 2.5x forward) and the largest difference from the first backend's output
    and query gradient."""
    H, Hkv, D = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, seq, h, D, generator=gen).to(device, torch.bfloat16) for h in (H, Hkv, Hkv))
    g = torch.randn(1, seq, H, D, generator=gen).to(device, torch.bfloat16)
    pos = torch.arange(seq)[None]
    flops = 3.5 * 2 * 2 * seq * seq / 2 * H * D
    ref, parts = None, []
    for name in backends:
        try:
            attn = PackedCausalAttention(pos, backend=name, device=device)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]

            def run():
                for x in leaves:
                    x.grad = None
                out = attn(0, *leaves, D ** -0.5)
                out.backward(g)
                return out

            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                out = run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / iters * 1e3
            got = (out.detach().float(), leaves[0].grad.float())
            diff = "" if ref is None else (f", max|d out| {(got[0] - ref[0]).abs().max().item():.1e}"
                                           f" max|d dq| {(got[1] - ref[1]).abs().max().item():.1e}")
            ref = ref or got
            parts.append(f"{name} {ms:.2f} ms ({flops / ms / 1e9:.0f} TFLOP/s{diff})")
        except Exception as e:  # noqa: BLE001 - a backend this torch cannot run
            parts.append(f"{name} failed ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})")
    return f"one layer's attention fwd+bwd, {seq} tokens: " + "; ".join(parts)


def mfu(r: dict, peak_tflops: float) -> float:
    return r["tokens_per_s"] / r["world"] * r["flops_per_token"] / (peak_tflops * 1e12)


# ------------------------------------------------------------------ modes

def table(rows: list[list], header: list[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for line in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)))


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["dense", "moe", "dp", "cp", "all", "sweep"])
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=2, help="8k-token rows (micro-batches) per optimizer step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ac", default="none", choices=["none", "full", "selective"])
    ap.add_argument("--compile", action="store_true",
                    help="dense: also run with each block torch.compile'd (train.compile), side by side")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one profiled step")
    ap.add_argument("--attention", default="auto", choices=["auto", "varlen", "cudnn", "flex", "sdpa"],
                    help="dense: train.attention")
    ap.add_argument("--adamw", default="foreach", choices=["foreach", "fused"],
                    help="dense: train.optim.implementation")
    ap.add_argument("--reshard", default="micro_batch", choices=["micro_batch", "step"],
                    help="dense: train.parallel.reshard")
    ap.add_argument("--chunk", type=int, default=2048, help="dense: train.logprob_chunk_tokens")
    ap.add_argument("--no-fsdp", action="store_true", help="dense: rl-train's one-rank path (bf16 parameters)")
    ap.add_argument("--keep-logits", action="store_true", help="dense: train.logprob_keep_logits")
    ap.add_argument("--docs-per-row", type=int, default=1, help="dense: --seq-token documents packed per row")
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"sweep: comma-separated, in order, of {','.join(LEVERS)}")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--json-out", default="", help="write the results as JSON here (used by dp mode)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dense, moe = dict(LLAMA_1B), dict(QWEN3_MOE_2B)
    if a.smoke:
        dense.update(SMOKE)
        moe.update(SMOKE)
        a.seq, a.steps, a.warmup = min(a.seq, 256), 1, 1
    results: dict = {}
    if a.mode == "dp":
        return dp_mode(a)
    rank, world = setup_dist(device.type)
    if a.mode == "sweep":
        return sweep_mode(a, dense, device)
    arm = Arm("dense", attention=a.attention, adamw=a.adamw, reshard=a.reshard, chunk=a.chunk, fsdp=not a.no_fsdp,
              keep_logits=a.keep_logits, docs_per_row=a.docs_per_row)
    if a.mode in ("dense", "all"):
        results["dense"] = run_config(dense, a.seq, a.rows, a.steps, a.warmup, device, a.ac, arm=arm,
                                      profile=a.profile)
        if a.compile:
            results["dense_compiled"] = run_config(dense, a.seq, a.rows, a.steps, a.warmup, device, a.ac,
                                                   arm=dataclasses.replace(arm, compile=True), profile=a.profile)
    if a.mode in ("moe", "all"):
        for experts in ("loop", "grouped"):
            results[f"moe_{experts}"] = run_config(moe, a.seq, a.rows, a.steps, a.warmup, device, a.ac, experts)
    if a.mode == "cp":
        results["cp"] = cp_mode(a, dense, device)
    if rank == 0:
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(results))
        rows = []
        for name, r in results.items():
            if name == "cp":
                continue
            rows.append([name, f"{r['params'] / 1e9:.2f}B", world, a.seq, fmt(r["tokens_per_s"], 0),
                         f"{100 * mfu(r, a.peak_tflops):.1f}%", fmt(r["peak_mem_gib"], 1)])
        if rows:
            print(f"# device={torch.cuda.get_device_name() if cuda else 'cpu'} ac={a.ac} rows={a.rows} "
                  f"flops/token=6N+6*L*d*seq")
            table(rows, ["config", "params", "gpus", "seq", "tokens/s", "MFU", "peak GiB"])
        if "dense_compiled" in results:
            print(f"compiled / eager tokens/s: "
                  f"{results['dense_compiled']['tokens_per_s'] / results['dense']['tokens_per_s']:.2f}x")
        if "moe_loop" in results:
            print(f"grouped GEMM / expert loop tokens/s: "
                  f"{results['moe_grouped']['tokens_per_s'] / results['moe_loop']['tokens_per_s']:.2f}x")
        if "cp" in results:
            print(json.dumps(results["cp"]))
    dist.destroy_process_group()


def sweep_mode(a, dense: dict, device: torch.device) -> None:
    """Greedy over the levers of --arms (see LEVERS), in one process: a row per arm as it
    finishes (an arm that fails prints its error and is not kept), then one table and the
    rl-train flags of the best configuration."""
    rank = dist.get_rank()
    names = [n.strip() for n in a.arms.split(",") if n.strip()]
    unknown = [n for n in names if n not in LEVERS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {list(LEVERS)}")
    header = ["arm", "compile", "attention", "adamw", "reshard", "chunk", "keep", "docs/row", "fsdp", "tokens/s",
              "MFU", "step s", "peak GiB", "recompiles", "kept"]
    if rank == 0:
        print(attention_report(device, dense, a.seq), flush=True)
        kernels = ["varlen", "cudnn", "sdpa"] if device.type == "cuda" else ["sdpa", "cudnn"]
        print(attention_kernels(device, dense, a.seq, kernels), flush=True)
        print(f"# device={torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'} seq={a.seq} "
              f"rows={a.rows} steps={a.steps} warmup={a.warmup} ac={a.ac} peak={a.peak_tflops} TFLOP/s", flush=True)
    rows, t_start = [], time.perf_counter()
    best, best_tps = Arm("compiled", compile=True, attention="varlen"), 0.0  # the step before these levers
    for name in names:
        arm = dataclasses.replace(best, name=name, **LEVERS[name])
        desc = [name, arm.compile, arm.attention, arm.adamw, arm.reshard, arm.chunk, arm.keep_logits, arm.docs_per_row,
                arm.fsdp]
        t0 = time.perf_counter()
        try:
            r = run_config(dense, a.seq, a.rows, a.steps, a.warmup, device, a.ac, arm=arm, profile=a.profile)
            better = r["tokens_per_s"] > best_tps and name not in REPORT_ONLY
            row = desc + [fmt(r["tokens_per_s"], 0), f"{100 * mfu(r, a.peak_tflops):.1f}%", f"{r['step_s']:.3f}",
                          fmt(r["peak_mem_gib"], 1), r["graphs_in_timing"],
                          "info" if name in REPORT_ONLY else "yes" if better else "no"]
            if better:
                best, best_tps = arm, r["tokens_per_s"]
        except Exception as e:  # noqa: BLE001 - one arm's failure (OOM, missing kernel) must not end the sweep
            row = desc + [f"failed: {type(e).__name__}: {str(e).splitlines()[0][:90] if str(e) else ''}", "", "", "",
                          "", "no"]
            torch._dynamo.reset()
        release_memory(device.type == "cuda")
        rows.append(row)
        if rank == 0:
            left = f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated" if device.type == "cuda" else ""
            print(f"[{time.perf_counter() - t_start:6.0f}s] {name}: {row[len(desc):]} ({time.perf_counter() - t0:.0f}s"
                  f"{left})", flush=True)
    if rank == 0:
        table(rows, header)
        flags = (["--compile"] if best.compile else []) + [
            f"--train.attention {best.attention}", f"--train.optim.implementation {best.adamw}",
            f"--train.parallel.reshard {best.reshard}", f"--train.logprob_chunk_tokens {best.chunk}",
            f"--train.logprob_keep_logits {str(best.keep_logits).lower()}",
            f"--train.micro_batch_tokens {best.docs_per_row * a.seq} (rows of {best.docs_per_row} x {a.seq})"]
        print(f"best: {best.name} {fmt(best_tps, 0)} tokens/s; rl-train {' '.join(flags)}")
    dist.destroy_process_group()


def dp_mode(a) -> None:
    """One GPU vs two (FSDP2 over 2 ranks), same per-GPU work, each under its own torchrun."""
    out = {}
    for n in (1, 2):
        path = Path(f"/tmp/train_throughput_dp{n}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               __file__, "dense", f"--seq={a.seq}", f"--rows={a.rows}", f"--steps={a.steps}",
               f"--warmup={a.warmup}", f"--ac={a.ac}", f"--json-out={path}"] + (["--smoke"] if a.smoke else [])
        subprocess.run(cmd, check=True)
        out[n] = json.loads(path.read_text())["dense"]
    rows = [[f"--dp {n}", n, fmt(r["tokens_per_s"], 0), fmt(r["tokens_per_s"] / n, 0), f"{100 * mfu(r, a.peak_tflops):.1f}%",
             fmt(r["peak_mem_gib"], 1)] for n, r in out.items()]
    table(rows, ["config", "gpus", "tokens/s", "tokens/s/gpu", "MFU", "peak GiB"])
    print(f"--dp 2 / 1 GPU throughput: {out[2]['tokens_per_s'] / out[1]['tokens_per_s']:.2f}x")


def cp_mode(a, dense: dict, device: torch.device) -> dict:
    """Longest sequence (doubling from --seq up to 131072) one step trains with --cp = world size:
    every rank holds two load-balanced chunks of the row; K/V are all-gathered per layer."""
    try:
        from rlcli.parallel.context import apply_cp, next_token_targets, shard_batch_for_cp
    except ImportError:
        return {"cp": "rlcli.parallel.context is not in this build: no --cp figure"}
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    args = ModelArgs.from_hf(dense)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    model = build_model(args, device="meta", dtype=torch.float32, materialize=False)
    apply_cp(model, mesh)
    apply_activation_checkpointing(model, a.ac)
    apply_fsdp(model, mesh, torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.to_empty(device=device)
    model.init_buffers()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().fill_(1.0) if name.endswith("norm.weight") else p.to_local().normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    results, seq = {}, a.seq
    while seq <= (1024 if a.smoke else 131072):
        ids = torch.randint(0, args.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq)).to(device)
        pos = torch.arange(seq, device=device)[None]
        t = next_token_targets({"input_ids": ids, "position_ids": pos,
                                "loss_mask": torch.ones_like(ids, dtype=torch.bool),
                                "advantages": torch.ones(1, seq, device=device)})
        try:
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            local, attn = shard_batch_for_cp(t, rank, world, host_position_ids=pos.cpu())
            h = model.hidden_states(local["input_ids"], local["position_ids"], ForwardContext(attn=attn))[0]
            lp, _ = chunked_logprobs(h, model.lm_head.weight, local["targets"][0], 1.0, 2048)
            (-(lp.exp() * local["advantages"][0] * local["loss_mask"][0]).sum() / seq).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            results[seq] = {"ok": True, "step_s": round(time.perf_counter() - t0, 2), "peak_mem_gib": round(peak, 1)}
        except torch.OutOfMemoryError:
            results[seq] = {"ok": False, "error": "out of memory"}
            break
        seq *= 2
    ok = [s for s, r in results.items() if r["ok"]]
    return {"cp": world, "longest_seq_trained": max(ok) if ok else 0, "per_seq": results}


if __name__ == "__main__":
    main()
