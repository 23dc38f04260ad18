"""A full training step (forward + backward + AdamW) in FP8 against bf16, same model, same data.

    python bench/fp8_train_step.py --noise         # H200: ~1B dense Llama and a small Qwen3-MoE, 50 steps each
    python bench/fp8_train_step.py --models dense --modes eager,graph   # also the step as one CUDA graph
    python bench/fp8_train_step.py --models dense --modes compile       # decoder blocks compiled (rl-train --compile)
    python bench/fp8_train_step.py --smoke         # CPU: tiny models, emulated FP8, 6 steps

Each model is built twice from the same seed (bf16 parameters on GPU, fp32 on CPU; AdamW), once left as is and
once passed through ``convert_to_fp8`` (every Linear except lm_head, plus the stacked
experts; router and embeddings stay bf16). The bf16 MoE baseline is the model's own grouped
experts (one bf16 grouped GEMM per projection). Both train on the same sequence of batches
(a fixed pool of token sequences made of repeated random motifs, so the loss falls within
50 steps). It prints the median step time of each (after warm-up: DeepGEMM JIT-compiles
every new shape, 5-9 s each, in the first steps), the speed-up, and both loss curves
(every 5th step side by side, and the largest |loss_fp8 - loss_bf16| over all steps, read
against two bf16 runs from different init seeds with ``--noise``). ``--modes graph`` runs
both arms again with the whole step (forward, backward, clipping, capturable AdamW) captured
once as a CUDA graph and replayed: the step's device time without host overhead;
``--modes compile`` with each decoder block compiled in place, as ``rl-train --compile``.

On the GPU it then profiles one step of each arm and prints GPU time per kernel class (FP8
GEMMs, bf16 GEMMs, quantization, attention, optimizer, elementwise/other), the top FP8-step
kernels and host ops, the weight-gradient kernel DeepGEMM's backend chose per shape, and a
host-vs-device table: wall and host (enqueue) time per step, device busy time, kernels,
launch calls, host syncs and aten ops per step, and whether the step is host- or device-bound.
Quantizers: the Triton kernels on CUDA (``--quant auto``), or the torch reference (``--quant torch``).
Needs torch + safetensors (rlcli.models, rlcli.ops.fp8); no msgspec/zmq.
"""

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if os.path.isdir(os.path.join(ROOT, ".dg")):
    sys.path.insert(0, os.path.join(ROOT, ".dg"))

from rlcli.models import ModelArgs, build_model  # noqa: E402
from rlcli.ops.fp8.backends import TorchScaledMMBackend, make_backend  # noqa: E402
from rlcli.ops.fp8.convert import convert_to_fp8  # noqa: E402
from rlcli.ops.fp8 import runtime  # noqa: E402

DENSE_1B = {"model_type": "llama", "vocab_size": 32768, "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
MOE_SMALL = {"model_type": "qwen3_moe", "vocab_size": 32768, "hidden_size": 2048, "intermediate_size": 6144,
             "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
             "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 1024, "norm_topk_prob": True,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
SMOKE_DENSE = {**DENSE_1B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
SMOKE_MOE = {**MOE_SMALL, "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 128}


def batches(vocab: int, batch: int, seq: int, pool: int, seed: int) -> list[torch.Tensor]:
    """``pool`` batches of sequences that repeat a random 16-token motif (learnable by copying)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(pool):
        motif = torch.randint(0, vocab, (batch, 16), generator=gen)
        out.append(motif.repeat(1, seq // 16 + 1)[:, :seq].contiguous())
    return out


def classify(name: str) -> str:
    """Kernel class of a CUDA kernel name (aten op names on the CPU)."""
    import re

    def has(pattern: str) -> bool:
        return re.search(pattern, name, re.IGNORECASE) is not None

    if has(r"_quant_kernel"):
        return "quant"
    if has(r"^_grouped_kernel$"):  # rlcli.ops.fp8.grouped_triton
        return "fp8 gemm"
    if has(r"flash|fmha|attention|sdpa"):
        return "attention"
    if has(r"^triton_(poi|red|per)_"):
        # inductor's fused pointwise/reduction kernels are named after the ops they fuse, consumers too: a
        # quantization fused into a SwiGLU backward reads "..._div_fp8_gemm_..." and is no GEMM
        return "quant" if has(r"amax|float8|e4m3|fp8") else "elementwise/other"
    if has(r"deep_gemm|gemm|cutlass|xmma|nvjet|^aten::(mm|addmm|bmm|_grouped_mm)$"):
        # cuBLASLt's nvjet kernels name FP8 (e4m3) operands "qq": nvjet_sm90_qqtst_... is scaled_mm
        fp8 = has(r"deep_gemm|fp8|f8|e4m3|float8|blockwise|scaled_mm|nvjet_sm\d+_qq|nvjet_qq")
        return "fp8 gemm" if fp8 else "bf16 gemm"
    if has(r"amax|float8|e4m3|fp8"):
        return "quant"
    if has(r"multi_tensor|adam|foreach|lerp|addcdiv"):
        return "optimizer"
    return "elementwise/other"


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaLaunchCooperativeKernel", "cudaGraphLaunch", "cuGraphLaunch")


def profile_step(run_step, cuda: bool) -> dict:
    """One full step (forward, backward, optimizer) under the profiler: device ms per kernel class,
    the top kernels, and the host side: kernels run, launch calls, host syncs, aten ops, busy device
    time (union of kernel intervals) and the host ops with the most self time."""
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        run_step()
        if cuda:
            torch.cuda.synchronize()
    classes, kernels, spans = {}, {}, []
    launches = syncs = aten = 0
    for ev in p.events():  # CPU (--smoke): self time of aten ops stands in for kernels
        is_dev = ev.device_type != torch.autograd.DeviceType.CPU
        if is_dev and "#" in ev.name:  # a GPU-side user annotation (Optimizer.step#AdamW.step), not a kernel
            continue
        if not is_dev:
            launches += ev.name in LAUNCHES
            syncs += "Synchronize" in ev.name
            aten += ev.name.startswith("aten::")
        if cuda and not is_dev:
            continue
        if not cuda and not ev.name.startswith("aten::"):
            continue
        ms = (ev.time_range.elapsed_us() if cuda else ev.self_cpu_time_total) / 1e3
        if cuda:
            spans.append((ev.time_range.start, ev.time_range.end))
        classes[classify(ev.name)] = classes.get(classify(ev.name), 0.0) + ms
        kernels[ev.name] = kernels.get(ev.name, 0.0) + ms
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):  # union of kernel intervals: time the device was doing anything
        if b > end:
            busy += b - max(a, end)
            end = b
    host = sorted(((k.key, k.count, k.self_cpu_time_total / 1e3) for k in p.key_averages()
                   if k.self_cpu_time_total > 0), key=lambda t: -t[2])[:10]
    return {"classes": classes, "top": sorted(kernels.items(), key=lambda kv: -kv[1])[:12],
            "kernels": len(spans) if cuda else sum(1 for e in p.events() if e.name.startswith("aten::")),
            "launches": launches, "syncs": max(syncs - cuda, 0), "aten": aten, "busy_ms": busy / 1e3,
            "host_top": host}


def context(ids: torch.Tensor, device):
    """Positions on the device and the packed-causal attention context built from host positions, as
    rl-train builds it (reading document boundaries off device positions would sync every step)."""
    from rlcli.ops.attention import ForwardContext
    from rlcli.ops.document_attention import PackedCausalAttention

    B, T = ids.shape[0], ids.shape[1] - 1
    pos = torch.arange(T).expand(B, T)
    pos_dev = pos.to(device)
    return pos_dev, ForwardContext(attn=PackedCausalAttention(pos, device=device), position_ids=pos_dev)


def make_step(model, opt, graph: bool, data: list[torch.Tensor], device):
    """``run(ids) -> loss tensor``: one full step, eager, or replaying a CUDA graph of it (``graph``:
    three eager warm-up steps on a side stream, then one capture with one attention context built
    before it; returns the warm-up losses too)."""
    def body(ids, pos_ctx=None):
        pos, ctx = pos_ctx if pos_ctx is not None else context(ids, device)
        logits = model(ids[:, :-1], pos, ctx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    if not graph:
        def run(ids):
            loss = body(ids)
            opt.zero_grad(set_to_none=True)
            return loss
        return run, []
    static = data[0].to(device).clone()
    pos_ctx = context(static, device)  # its varlen plan is built by the first warm-up step, before the capture
    warm = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):  # real training steps; also JIT-compiles every kernel before the capture
            static.copy_(data[i % len(data)])
            warm.append(body(static, pos_ctx).item())
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph_ = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_):  # grads are None here, so backward writes (not adds) them on every replay
        static_loss = body(static, pos_ctx)

    def run(ids):
        static.copy_(ids)
        graph_.replay()
        return static_loss
    run.graph = graph_  # keep it alive with the closure
    return run, warm


def build_arm(hf: dict, arm: str, backend: str, device, seed: int = 0):
    """``(model, FP8 GEMM backend or None)`` of one arm (see :func:`train`), weights from ``seed``."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU bf16 matmuls are slow
    model = build_model(ModelArgs.from_hf(hf), device=device, dtype=dtype)
    model.init_weights(seed=seed)
    if arm == "bf16":
        return model, None
    cfg = SimpleNamespace(backend=backend, include=["*"], exclude=["*embed_tokens", "lm_head", "*.mlp.gate"],
                          ue8m0=False, fuse_siblings={"fp8": ["qkv"], "fp8-loop": ["qkv"], "fp8-gate-up": ["qkv", "gate_up"]}.get(arm, []))
    gemm = make_backend(backend, device)
    if arm == "fp8-loop":  # the torch backend's grouped GEMMs as a loop of scaled_mm over the experts (before the Triton kernel)
        if not isinstance(gemm, TorchScaledMMBackend):
            raise SystemExit(f"--arms fp8-loop needs --backend torch, got {gemm.name}")
        gemm.grouped_on_device = False
    convert_to_fp8(model, cfg, device, backend=gemm)
    return model, gemm


def train(hf: dict, arm: str, backend: str, data: list[torch.Tensor], steps: int, device, lr: float,
          seed: int = 0, profile: bool = False, graph: bool = False, compile_blocks: bool = False):
    """``arm``: bf16, fp8 (q/k/v stacked, rl-train's default), fp8-gate-up (gate/up stacked too), fp8-unfused,
    or fp8-loop (fp8 with the torch backend's grouped GEMMs looped over the experts, the path before
    rlcli.ops.fp8.grouped_triton served training)."""
    model, gemm = build_arm(hf, arm, backend, device, seed)
    if compile_blocks:  # as rl-train --compile: each decoder block compiled in place (FP8 linears run eagerly between its pieces)
        for block in model.model.layers:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                            **({"capturable": True} if graph else {}))
    run, losses = make_step(model, opt, graph, data, device)
    times, host = [float("nan")] * len(losses), [float("nan")] * len(losses)
    for step in range(len(losses), steps):
        ids = data[step % len(data)].to(device)
        t0 = time.perf_counter()
        loss = run(ids)
        t1 = time.perf_counter()  # everything enqueued (or a host sync inside made us wait)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        host.append(t1 - t0)
        losses.append(loss.item())
    breakdown = profile_step(lambda: run(data[0].to(device)), device.type == "cuda") if profile else None
    if breakdown is not None and hasattr(gemm, "wgrad_choice"):  # DeepGEMM: which kernel each wgrad shape took
        breakdown["wgrad"] = dict(gemm.wgrad_choice)
        breakdown["wgrad_ms"] = dict(gemm.wgrad_ms)
        breakdown["failed"] = sorted(gemm.failed)
    n_params = sum(p.numel() for p in model.parameters())
    del model, opt, run
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"losses": losses, "times": times, "host": host, "n": n_params, "prof": breakdown}


def host_costs(backend_name: str, device, M: int, N: int, K: int, calls: int = 20) -> list[tuple[str, float]]:
    """Host µs per call of each piece of an FP8 linear, at shape [M, K] x [N, K]: ``calls`` calls
    enqueued back to back without a sync (few enough that the launch queue never fills), so the
    time is what the host spends, not the GPU."""
    from rlcli.ops.fp8.linear import fp8_linear

    be = make_backend(backend_name, device)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
    (xq, xs), (xtq, xts) = runtime.quantize_act(x, False, True, True)
    (wq, ws), _ = runtime.quantize_weight(w, False, True)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    (dytq, dyts) = runtime.quantize_act(dy, False, rows=False, cols=True)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    pieces = [("bf16 torch.mm", lambda: torch.mm(x, w.t())),
              ("quantize x rows+cols (one kernel)", lambda: runtime.quantize_act(x, False, True, True)),
              ("fp8 gemm 1x128 . 128x128", lambda: be.gemm(xq, xs, wq, ws, torch.bfloat16)),
              ("fp8 wgrad, backend's choice", lambda: be.gemm_1x128(dytq, dyts, xtq, xts, torch.bfloat16))]
    if hasattr(be, "_wgrad_1d1d"):
        pieces += [("fp8 wgrad DeepGEMM 1D1D (+zeros)", lambda: be._wgrad_1d1d(dytq, dyts, xtq, xts)),
                   ("fp8 wgrad scaled_mm", lambda: be.torch.gemm_1x128(dytq, dyts, xtq, xts, torch.bfloat16))]
    pieces += [("bf16 linear fwd+bwd", lambda: F.linear(xb, wb).backward(dy)),
               ("fp8 linear fwd+bwd (weight quantized too)", lambda: fp8_linear(xr, wr, None, be).backward(dy))]
    out = []
    for name, fn in pieces:
        try:
            fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((name, (time.perf_counter() - t0) / calls * 1e6))
            sync()
        except Exception as e:  # noqa: BLE001
            out.append((f"{name} (failed: {type(e).__name__}: {str(e)[:80]})", float("nan")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU, emulated FP8")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--backend", default="auto", choices=["auto", "deep_gemm", "torch", "emulated"])
    ap.add_argument("--quant", default="auto", choices=["auto", "torch", "triton"],
                    help="quantizers: Triton on CUDA (auto) or the torch reference")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel breakdown (GPU)")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--modes", default="eager",
                    help="comma list: eager (as rl-train runs), compile (each decoder block compiled, as rl-train "
                         "--compile) and/or graph (the whole step as one CUDA graph, capturable AdamW: the step "
                         "without host overhead)")
    ap.add_argument("--arms", default="bf16,fp8",
                    help="comma list of bf16, fp8 (q/k/v stacked: rl-train's default), fp8-gate-up (gate/up "
                         "stacked too), fp8-unfused, fp8-loop (MoE experts looped, --backend torch)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--profile", action="store_true", help="(default on the GPU; kept for old command lines)")
    ap.add_argument("--noise", action="store_true",
                    help="also train bf16 from another init seed: max|dL| between two bf16 runs, the scale of "
                         "run-to-run noise the FP8 difference is read against")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        args.steps, args.batch, args.seq = min(args.steps, 6), 2, 64
    runtime.IMPL["name"] = args.quant
    profile = (device.type == "cuda" or args.smoke) and not args.no_profile
    modes = [m for m in args.modes.split(",") if m != "graph" or device.type == "cuda"]
    arms = args.arms.split(",")
    configs = {"dense": SMOKE_DENSE if args.smoke else DENSE_1B, "moe": SMOKE_MOE if args.smoke else MOE_SMALL}
    warm = min(10, args.steps // 2)
    results, curves, breakdowns, hosts = [], {}, {}, []
    for key in args.models.split(","):
        hf = configs[key]
        data = batches(hf["vocab_size"], args.batch, args.seq + 1, 8, seed=1)
        for mode in modes:
            runs = {}
            for arm in arms:
                tag = arm + ("" if mode == "eager" else f" {mode}")
                try:
                    runs[arm] = train(hf, arm, args.backend, data, args.steps, device, args.lr, profile=profile,
                                      graph=mode == "graph", compile_blocks=mode == "compile")
                except Exception as e:  # noqa: BLE001 -- report the arm as failed, keep the others
                    print(f"{key} {tag}: FAILED {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                r = runs[arm]
                print(f"{key} {tag} median step {median(r['times'][warm:]) * 1e3:.1f} ms; loss every 10 steps: "
                      + " ".join(f"{x:.3f}" for x in r["losses"][::10]) + f" ... last {r['losses'][-1]:.4f}",
                      file=sys.stderr, flush=True)
                if r["prof"] is not None:
                    hosts.append((f"{key} {tag}", r))
            name = key if mode == "eager" else f"{key} {mode}"
            for arm, r in runs.items():
                curves[f"{name} {arm}"] = r["losses"]
            if "bf16" not in runs:
                continue
            noise = float("nan")
            if args.noise and mode == "eager":
                other = train(hf, "bf16", args.backend, data, args.steps, device, args.lr, seed=1)["losses"]
                curves[f"{name} bf16 s1"] = other
                noise = max(abs(a - b) for a, b in zip(other, runs["bf16"]["losses"]))
            fp8_arm = next((a for a in ("fp8", "fp8-gate-up", "fp8-unfused") if a in runs), None)
            if profile and fp8_arm is not None:
                breakdowns[name] = {False: runs["bf16"]["prof"], True: runs[fp8_arm]["prof"], "arm": fp8_arm}
            if profile and mode == "eager" and fp8_arm is not None:
                top = runs[fp8_arm]["prof"]
                print(f"\n{name}: top kernels of one {fp8_arm} step (GPU ms)", file=sys.stderr)
                for kname, ms in top["top"]:
                    print(f"  {ms:8.2f}  {kname[:110]}", file=sys.stderr)
                print(f"{name}: host ops with the most self time in one {fp8_arm} step (count, ms)", file=sys.stderr)
                for hname, count, ms in top["host_top"]:
                    print(f"  {count:6d} {ms:8.2f}  {hname[:100]}", file=sys.stderr)
            for arm in runs:
                if arm == "bf16":
                    continue
                diff = max(abs(a - b) for a, b in zip(runs[arm]["losses"], runs["bf16"]["losses"]))
                results.append((f"{name} {arm}", runs["bf16"]["n"], args.batch * args.seq,
                                median(runs["bf16"]["times"][warm:]), median(runs[arm]["times"][warm:]),
                                runs["bf16"]["losses"], runs[arm]["losses"], diff, noise))

    where = "CPU" if device.type == "cpu" else torch.cuda.get_device_name()
    print(f"\nLoss curves (every 5th step; 's1' = bf16 from init seed 1, the run-to-run noise)")
    names = list(curves)
    print(f"{'step':>4s} " + " ".join(f"{n:>22s}" for n in names))
    for i in list(range(0, args.steps, 5)) + ([args.steps - 1] if (args.steps - 1) % 5 else []):
        print(f"{i:4d} " + " ".join(f"{curves[n][i]:22.4f}" for n in names))
    for key, prof in breakdowns.items():
        print(f"\n{key}: device time of one step by kernel class (ms; profiled step, forward+backward+AdamW)")
        classes = sorted(set(prof[False]["classes"]) | set(prof[True]["classes"]))
        print(f"{'class':18s} {'bf16':>9s} {prof['arm']:>11s}")
        for c in classes + ["total"]:
            vb = sum(prof[False]["classes"].values()) if c == "total" else prof[False]["classes"].get(c, 0.0)
            vf = sum(prof[True]["classes"].values()) if c == "total" else prof[True]["classes"].get(c, 0.0)
            print(f"{c:18s} {vb:9.2f} {vf:11.2f}")
        if prof[True].get("wgrad") is not None:
            ms = prof[True]["wgrad_ms"]
            print("fp8 weight gradients (N x K, over M tokens): DeepGEMM 1D1D ms / scaled_mm ms -> kernel used")
            for (a, b), v in prof[True]["wgrad"].items():
                t = ms.get((a, b), {})
                print(f"  {a[0]}x{b[0]} over {a[1]}: {t.get('deep_gemm', float('nan')):.3f} / "
                      f"{t.get('torch', float('nan')):.3f} -> {v}")
            if prof[True]["failed"]:
                print(f"  DeepGEMM ops that fell back to scaled_mm: {', '.join(prof[True]['failed'])}")
    if hosts:
        print(f"\nHost vs device per arm (wall and host = medians of the timed steps; host = time to enqueue the "
              f"step; the rest from one profiled step: device kernels run, launch API calls, host syncs (the "
              f"profiled step's own input copy and synchronize included), aten ops, device busy = union of kernel "
              f"intervals; bound = host when enqueueing takes >= 0.9 of the busy time)")
        print(f"{'arm':24s} {'wall ms':>8s} {'host ms':>8s} {'busy ms':>8s} {'kernels':>8s} {'launches':>9s} "
              f"{'syncs':>6s} {'aten ops':>9s}  bound")
        for name, r in hosts:
            p, wall, hst = r["prof"], median(r["times"][warm:]) * 1e3, median(r["host"][warm:]) * 1e3
            bound = ("host" if hst >= 0.9 * p["busy_ms"] else "device") if p["busy_ms"] else "-"
            print(f"{name:24s} {wall:8.1f} {hst:8.1f} {p['busy_ms']:8.1f} {p['kernels']:8d} {p['launches']:9d} "
                  f"{p['syncs']:6d} {p['aten']:9d}  {bound}")
    if profile:
        M, K = args.batch * args.seq, configs["dense"]["hidden_size"]
        print(f"\nHost µs per call (enqueue only on the GPU, {M} tokens, {K}x{K} weight; a dense step runs "
              f"each linear's forward + backward once per layer)")
        for name, us in host_costs(args.backend, device, M, K, K, calls=20 if device.type == "cuda" else 2):
            print(f"  {us:8.1f}  {name}")
    quant = args.quant + (f" -> torch after Triton failed: {runtime.IMPL['failed']}" if "failed" in runtime.IMPL else "")
    print(f"\nTraining step, FP8 (backend {args.backend}, quantizers {quant}) vs bf16, {args.steps} steps, "
          f"{where}, torch {torch.__version__}")
    print(f"{'model, arm':23s} {'params':>8s} {'tok/step':>9s} {'bf16 ms':>9s} {'fp8 ms':>9s} {'speedup':>8s} "
          f"{'loss0':>7s} {'bf16 last':>10s} {'fp8 last':>9s} {'max|dL|':>8s} {'bf16 seeds max|dL|':>19s}")
    for key, n, tok, tb, tf, lb, lf, diff, noise in results:
        print(f"{key:23s} {n / 1e9:7.2f}B {tok:9d} {tb * 1e3:9.1f} {tf * 1e3:9.1f} {tb / tf:8.2f} "
              f"{lb[0]:7.3f} {lb[-1]:10.4f} {lf[-1]:9.4f} {diff:8.4f} {noise:19.4f}")


def median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x) or [float("nan")]  # graph warm-up steps carry no time (nan)
    return xs[len(xs) // 2]


if __name__ == "__main__":
    main()
