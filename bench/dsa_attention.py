"""DeepSeek Sparse Attention against dense MLA: one training step (forward + backward) of a
small DeepSeek-V3.2-shaped model at long context, and KV-cache bytes per token, latent
against expanded, for a DeepSeek-V3 layer.

The same weights run per length with DSA (lightning indexer, top-``index_topk`` selection,
:mod:`rlcli.ops.mla`) under each sparse attention kernel (``--kernels``: ``masked``, the top-k
as a boolean mask for SDPA over expanded K/V; ``gathered``, each query's selected latents
gathered per checkpointed chunk) and dense (the indexer switched off, expanded MLA through the
model's causal attention). It prints per length the peak memory and median step time of each,
and the ratio dense/DSA.

The phase split (skip it with ``--no-phases``) runs one DSA layer's pieces alone at the model's
shapes on random inputs: indexer scoring, top-k selection (and the former int64-key top-k on
the same scores, checking both choose the same tokens), sparse attention forward and backward
for each kernel, and dense causal attention forward and backward, each with its peak memory.
Needs only torch (no msgspec/zmq); the engine allocation line is printed where
``rlcli.infer`` imports.

    python bench/dsa_attention.py                   # GPU: lengths 32768, 65536, 131072
    python bench/dsa_attention.py --smoke           # CPU: a tiny model at 512 / 1024 tokens
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlcli.models.config import ModelArgs  # noqa: E402
from rlcli.models.hf_io import build_model  # noqa: E402
from rlcli.ops import dsa_triton, mla  # noqa: E402

# DeepSeek-V3.2's attention shapes on a narrow, shallow trunk with a dense MLP.
SMALL = dict(model_type="deepseek_v32", vocab_size=8192, hidden_size=2048, intermediate_size=4096,
             num_hidden_layers=4, num_attention_heads=16, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=256, first_k_dense_replace=4, q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_topk=2048, index_n_heads=64,
             index_head_dim=128, max_position_embeddings=163840)
SMOKE = dict(SMALL, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, first_k_dense_replace=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, index_topk=64, index_n_heads=4, index_head_dim=16)
DEEPSEEK_V3_LAYER = dict(num_attention_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128)


def set_dense(model, dense: bool) -> None:
    """Switch every layer between DSA (latent, sparse) and dense expanded MLA, same weights."""
    for layer in model.model.layers:
        attn = layer.self_attn
        if not hasattr(attn, "_indexer"):
            attn._indexer = attn.indexer
        attn.sparse, attn.indexer = (False, None) if dense else (True, attn._indexer)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_step(model, ids_BT: torch.Tensor) -> None:
    logits = model(ids_BT)
    loss = F.cross_entropy(logits[0, :-1].float(), ids_BT[0, 1:])
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure(model, T: int, steps: int, device: torch.device) -> tuple[float, float] | str:
    """(median seconds per step, peak GiB) or 'OOM'."""
    ids = torch.randint(0, model.args.vocab_size, (1, T), device=device)
    times = []
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for i in range(steps + 1):
            sync(device)
            t0 = time.perf_counter()
            train_step(model, ids)
            sync(device)
            if i:  # the first step warms up
                times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return "OOM"
    except Exception as e:  # a kernel that fails on this machine: report it, measure the rest
        model.zero_grad(set_to_none=True)
        print(f"T={T}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
        return type(e).__name__
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


class Clock:
    """Wall time (device-synchronized) and peak memory of one phase."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated() if self.device.type == "cuda" else 0
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.s = time.perf_counter() - self.t0
        cuda = self.device.type == "cuda"
        self.gib = (torch.cuda.max_memory_allocated() - self.base) / 2**30 if cuda else float("nan")


class Timed:
    """Wraps ``mla.<name>`` (looked up at call time by :func:`mla.select_topk`) to add up its
    synchronized wall time; ``also`` runs a second function on the same arguments, timed apart."""

    def __init__(self, name: str, device: torch.device, also=None):
        self.name, self.device, self.also = name, device, also
        self.s = self.also_s = 0.0
        self.mismatched_rows = 0

    def __enter__(self):
        self.f = getattr(mla, self.name)

        def wrapped(*args):
            sync(self.device)
            t0 = time.perf_counter()
            out = self.f(*args)
            sync(self.device)
            self.s += time.perf_counter() - t0
            if self.also is not None:
                t0 = time.perf_counter()
                ref = self.also(*args)
                sync(self.device)
                self.also_s += time.perf_counter() - t0
                same = (out.sort(-1).values == ref.sort(-1).values).all(-1)
                self.mismatched_rows += int((~same).sum())
            return out

        setattr(mla, self.name, wrapped)
        return self

    def __exit__(self, *exc):
        setattr(mla, self.name, self.f)


def layer_phases(cfg: dict, T: int, device: torch.device, dtype: torch.dtype, kernels: list[str]) -> dict:
    """One DSA layer's phases alone at the model's shapes, random inputs: {phase: (seconds, GiB)}."""
    gen = torch.Generator(device).manual_seed(T)
    H, R, dr = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    Hi, Di, k, V = cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"], cfg["v_head_dim"]
    D = cfg["qk_nope_head_dim"] + dr

    def rand(*shape, dt=dtype, grad=False):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt).requires_grad_(grad)

    out = {}
    iq, iw, ik = rand(T, Hi, Di), rand(T, Hi, dt=torch.float32), rand(T, Di)
    rows = torch.arange(T, device=device)
    sels = {}
    for fused in ([False, True] if dsa_triton.available(iq) else [False]):
        mla.TRITON = fused
        name = "fused Triton" if fused else "torch"
        try:
            with Timed("index_scores", device) as score, \
                    Timed("_topk_earliest", device, also=None if fused else mla._topk_earliest_int64) as top:
                with Clock(device) as c:
                    sels[fused] = mla.select_topk(iq, iw, ik, torch.zeros_like(rows), rows, k, Di ** -0.5)
        except Exception as e:  # a kernel that fails (or runs out of memory) here: report it, measure the rest
            print(f"select, {name} scores, T={T}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            out[f"select, {name} scores"] = (type(e).__name__[:8], float("nan"))
            continue
        out[f"select, {name} scores"] = (c.s, c.gib)
        out[f"  {name}: indexer scoring"] = (score.s, float("nan"))
        out[f"  {name}: top-k (float top-k + tie fix-up)"] = (top.s, float("nan"))
        if not fused:
            out[f"  top-k int64 key (old; rows choosing otherwise: {top.mismatched_rows})"] = (top.also_s, float("nan"))
    mla.TRITON = None
    if len(sels) == 2:
        same = ((sels[False][0].sort(-1).values == sels[True][0].sort(-1).values).all(-1)).float().mean()
        out[f"  (rows selecting the same tokens, fused vs torch scores: {100 * float(same):.2f}%)"] = ("", float("nan"))
    if not sels:
        return out
    idx, valid = sels[max(sels)]
    del iq, iw, ik
    scale = D ** -0.5

    def fwd_bwd(name, fn, *inputs):
        try:
            with Clock(device) as f:
                o = fn(*inputs)
            g = torch.randn_like(o)
            with Clock(device) as b:
                o.backward(g)
            out[f"{name} forward"], out[f"{name} backward"] = (f.s, f.gib), (b.s, b.gib)
        except torch.cuda.OutOfMemoryError:
            out[f"{name} forward"] = ("OOM", float("nan"))
        except Exception as e:  # a kernel that fails on this machine: report it, measure the rest
            print(f"{name}, T={T}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            out[f"{name} forward"] = (type(e).__name__[:8], float("nan"))
        finally:
            for x in inputs:
                if isinstance(x, torch.Tensor):
                    x.grad = None

    for kernel in kernels:
        if kernel == "triton":
            if dsa_triton.available(idx) and dsa_triton.attention_supported(R, dr):
                fwd_bwd("attention triton", lambda q, kv: dsa_triton.sparse_attention(q, kv, idx, valid, R, scale),
                        rand(T, H, R + dr, grad=True), rand(T, R + dr, grad=True))
        elif kernel == "masked":
            fwd_bwd("attention masked", lambda q, kk, v: mla.masked_dense_attention(q, kk, v, idx, valid, rows, scale),
                    rand(T, H, D, grad=True), rand(T, H, D, grad=True), rand(T, H, V, grad=True))
        else:
            fwd_bwd(f"attention {kernel}", lambda q, kv: mla.sparse_latent_attention(q, kv, idx, valid, R, scale),
                    rand(T, H, R + dr, grad=True), rand(T, R + dr, grad=True))
    # Dense causal attention over expanded heads (v padded to the q/k head size, as the model's varlen flash path).
    fwd_bwd("attention dense", lambda q, kk, v: F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kk.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=scale),
        rand(T, H, D, grad=True), rand(T, H, D, grad=True), rand(T, H, D, grad=True))
    return out




def kv_bytes(dtype_bytes: int) -> None:
    a = DEEPSEEK_V3_LAYER
    latent = a["kv_lora_rank"] + a["qk_rope_head_dim"]
    indexer = SMALL["index_head_dim"]
    expanded = a["num_attention_heads"] * (a["qk_nope_head_dim"] + a["qk_rope_head_dim"] + a["v_head_dim"])
    print(f"KV bytes/token/layer, DeepSeek-V3 layer ({dtype_bytes}-byte values): latent {latent * dtype_bytes} "
          f"(+{indexer * dtype_bytes} DSA indexer key), expanded {expanded * dtype_bytes}: "
          f"{expanded / latent:.1f}x less ({expanded / (latent + indexer):.1f}x with the indexer key)")
    try:
        from rlcli.infer.engine import NativeEngine
    except ImportError as e:
        print(f"(engine allocation not measured here: {e})")
        return
    hf = dict(SMALL, hidden_size=256, intermediate_size=64, num_hidden_layers=1, first_k_dense_replace=1,
              vocab_size=64, **a)
    for name, cfg in (("deepseek_v3 (latent)", dict(hf, model_type="deepseek_v3")), ("deepseek_v32 (latent+indexer)", hf)):
        model = build_model(ModelArgs.from_hf(cfg), dtype=torch.bfloat16)
        model.init_weights()
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, kv_cache_memory_mb=16)
        total = sum(t.numel() * t.element_size() for layer in engine.kv_caches for t in layer)
        tokens = engine.blocks.num_blocks * engine.block_size
        print(f"engine allocation, {name}: {total / tokens:.0f} bytes/token/layer ({tokens} tokens in {total >> 20} MiB)")


def fused_scores_invariance(device: torch.device) -> str:
    """Whether the fused kernel's scores are bit-identical when the query rows, the key window
    and the key layout (shared / per-query, as the engine's decode batch) change."""
    if not dsa_triton.available(torch.empty(0, device=device)):
        return "fused scores: Triton not available"
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(1024, 64, 128, generator=gen, device=device).bfloat16()
    w, k = torch.randn(1024, 64, generator=gen, device=device), torch.randn(1024, 128, generator=gen, device=device)
    full = dsa_triton.index_scores(q, w, k.bfloat16(), 0.1)
    window = dsa_triton.index_scores(q[100:300], w[100:300], k[37:500].bfloat16(), 0.1)
    per_query = dsa_triton.index_scores(q[:8], w[:8], k[None, :500].bfloat16().expand(8, -1, -1), 0.1)
    return (f"fused scores bit-identical across row blocks/windows: {torch.equal(window, full[100:300, 37:500])}, "
            f"per-query vs shared keys: {torch.equal(per_query, full[:8, :500])}")


def selection_consistency(device: torch.device, T: int = 4096, k: int = 512) -> str:
    """Whether the trainer's selection (all T queries, in chunks of rows over their key windows)
    equals the engine's (one decode query at a time against its own prefix, and a padded decode
    batch with per-query keys) on this device's default path (the fused kernel on CUDA)."""
    gen = torch.Generator(device).manual_seed(1)
    q = torch.randn(T, 64, 128, generator=gen, device=device).bfloat16()
    w = torch.randn(T, 64, generator=gen, device=device)
    keys = torch.randn(T, 128, generator=gen, device=device).bfloat16()
    keys[T // 4:T // 4 + 100] = keys[T // 4 - 1]  # exact ties straddle the top-k cut for some queries
    t = torch.arange(T, device=device)
    lo = torch.zeros(T, dtype=torch.long, device=device)
    whole = mla.select_topk(q, w, keys, lo, t, k, 0.1)
    saved = mla.CUDA_CHUNK_ELEMENTS, mla.CHUNK_ELEMENTS
    mla.CUDA_CHUNK_ELEMENTS = mla.CHUNK_ELEMENTS = 16 * T * 37  # 37-row chunks
    try:
        chunked = mla.select_topk(q, w, keys, lo, t, k, 0.1)
    finally:
        mla.CUDA_CHUNK_ELEMENTS, mla.CHUNK_ELEMENTS = saved
    as_sets = lambda sel, i: set(sel[0][i][sel[1][i]].tolist())  # noqa: E731
    positions = sorted({p for p in (5, k - 1, k, T // 4 + 50, T // 2, 3000, T - 1) if p < T})
    decode_ok = all(as_sets(mla.select_topk(q[p:p + 1], w[p:p + 1], keys[:p + 1], lo[:1], t[p:p + 1], k, 0.1), 0)
                    == as_sets(whole, p) for p in positions)
    S = max(positions) + 1  # a padded decode batch: each row its own copy of the keys, masked past p
    rows = torch.tensor(positions, device=device)
    batch = mla.select_topk(q[rows], w[rows], keys[None, :S].expand(len(positions), -1, -1).contiguous(),
                            lo[:len(positions)], rows, k, 0.1)
    batch_ok = all(as_sets(batch, i) == as_sets(whole, p) for i, p in enumerate(positions))
    return (f"selection ({'fused' if mla._fused_scores(q) else 'torch'} scores, T={T}, k={k}): chunked == whole "
            f"{torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])}, "
            f"decode one query == trainer row {decode_ok}, padded decode batch == trainer rows {batch_ok}")


def use_kernel(kernel: str) -> None:
    """Select the DSA training path by its bench name: ``masked`` (the former CUDA path: torch
    scores, SDPA with the top-k as a mask), ``gathered`` (torch scores and gathered attention),
    ``triton`` (fused scores and the Triton sparse kernel)."""
    mla.MASKED_DENSE = kernel == "masked"
    mla.TRITON = kernel == "triton"


def seconds(x) -> str:
    return x if isinstance(x, str) else f"{x:.4f}"


def cells(r) -> tuple[str, str]:
    return (r, "") if isinstance(r, str) else (f"{r[0]:.3f}", f"{r[1]:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, short sequences")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--steps", type=int, default=1, help="timed steps per point (after one warm-up)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--topk", type=int, default=None, help="override index_topk")
    p.add_argument("--kernels", default=None, help="DSA paths to compare, comma-separated (masked, gathered, "
                   "triton); default all that run on the device")
    p.add_argument("--masked-max", type=int, default=65536,
                   help="longest length at which the (slow) masked kernel runs the whole model")
    p.add_argument("--no-phases", action="store_true", help="skip the one-layer phase split")
    p.add_argument("--no-model", action="store_true", help="only the phase split")
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    cfg = dict(SMOKE if args.smoke else SMALL)
    if args.topk:
        cfg.update(index_topk=args.topk)
    if args.layers:
        cfg.update(num_hidden_layers=args.layers, first_k_dense_replace=args.layers)
    lengths = args.lengths or ([512, 1024] if args.smoke else [32768, 65536, 131072])
    kernels = args.kernels.split(",") if args.kernels else ["masked", "gathered"]
    if not args.kernels and dsa_triton.available(torch.empty(0, device=device)):
        kernels.append("triton")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the indexer scores in fp32
    name = f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""
    fused = dsa_triton.available(torch.empty(0, device=device))
    print(f"torch {torch.__version__}, {device}{name}, triton kernels: {fused}")
    phases, rows = {}, []
    if device.type == "cuda":
        try:
            print(fused_scores_invariance(device), flush=True)
            print(selection_consistency(device), flush=True)
        except Exception as e:  # a kernel that fails on this machine: report it, measure the rest
            print(f"fused scores: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    if not args.no_phases:
        layer_phases(cfg, min(lengths[0], 2 * cfg["index_topk"]), device, dtype, kernels)  # warm-up
        for T in lengths:
            phases[T] = layer_phases(cfg, T, device, dtype, kernels)
            done = ", ".join(f"{n.strip()} {seconds(v[0])}" for n, v in phases[T].items())
            print(f"T={T} phases: {done}", flush=True)
    if not args.no_model:
        model = build_model(ModelArgs.from_hf(cfg), device=device, dtype=dtype)
        model.init_weights(seed=0)
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
              f"{cfg['num_attention_heads']} heads, index_topk {cfg['index_topk']}, {n_params / 1e6:.0f}M params, "
              f"{dtype}, {device}")
        for T in lengths:
            set_dense(model, True)
            res = {"dense": measure(model, T, args.steps, device)}
            set_dense(model, False)
            for kernel in kernels:
                if kernel == "masked" and T > args.masked_max:
                    res[kernel] = "skipped"
                    continue
                use_kernel(kernel)
                res[kernel] = measure(model, T, args.steps, device)
            mla.MASKED_DENSE = mla.TRITON = None
            rows.append((T, res))
            print(f"T={T}: " + ", ".join(f"{n} {r}" for n, r in res.items()), flush=True)
        kv_bytes(2)
    for T, ph in phases.items():
        print(f"\none DSA layer alone, {T} tokens (H={cfg['num_attention_heads']}, index heads "
              f"{cfg['index_n_heads']}x{cfg['index_head_dim']}, top-k {cfg['index_topk']}):")
        print(f"  {'phase':<52} {'seconds':>8} {'peak GiB':>8}")
        for name, (sec, gib) in ph.items():
            print(f"  {name:<52} {seconds(sec):>8} {'' if gib != gib else f'{gib:.2f}':>8}")
    if rows:
        print(f"\nwhole model, one training step: {'tokens':>8} | {'kernel':>9} | {'s/step':>8} {'peak GiB':>8} | "
              f"{'time dense/DSA':>14} {'mem dense/DSA':>13}")
        for T, res in rows:
            dense = res["dense"]
            for name, r in res.items():
                a, b = cells(r)
                ratio_t = ratio_m = "-"
                if name != "dense" and not isinstance(r, str) and not isinstance(dense, str):
                    ratio_t = f"{dense[0] / r[0]:.2f}x"
                    ratio_m = f"{dense[1] / r[1]:.2f}x" if device.type == "cuda" else "-"
                print(f"{'':>31} {T:>8} | {name:>9} | {a:>8} {b:>8} | {ratio_t:>14} {ratio_m:>13}")


if __name__ == "__main__":
    main()
