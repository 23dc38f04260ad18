"""DeepSeek Sparse Attention against dense MLA: one training step (forward + backward) of a
small DeepSeek-V3.2-shaped model at long context, and KV-cache bytes per token, latent
against expanded, for a DeepSeek-V3 layer.

The same weights run twice per length: with DSA (lightning indexer, top-``index_topk``
selection, :mod:`rlcli.ops.mla`; on CUDA the selection is a boolean mask for SDPA over
expanded K/V per query chunk) and dense (the indexer switched off, expanded MLA through
SDPA causal attention). It prints per length the peak memory and
median step time of both, and the ratios. Needs only torch (no msgspec/zmq); the engine
allocation line is printed where ``rlcli.infer`` imports.

    python bench/dsa_attention.py                   # GPU: lengths 32768, 65536, 131072
    python bench/dsa_attention.py --smoke           # CPU: a tiny model at 128 / 256 tokens
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
from rlcli.ops import mla  # noqa: E402

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
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, short sequences")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--steps", type=int, default=1, help="timed steps per point (after one warm-up)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    cfg = dict(SMOKE if args.smoke else SMALL)
    if args.layers:
        cfg.update(num_hidden_layers=args.layers, first_k_dense_replace=args.layers)
    lengths = args.lengths or ([128, 256] if args.smoke else [32768, 65536, 131072])
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the indexer scores in fp32
        mla.CHUNK_ELEMENTS = 1 << 31
    model = build_model(ModelArgs.from_hf(cfg), device=device, dtype=dtype)
    model.init_weights(seed=0)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, "
          f"index_topk {cfg['index_topk']}, {n_params / 1e6:.0f}M params, {dtype}, {device}")
    rows = []
    for T in lengths:
        set_dense(model, False)
        dsa = measure(model, T, args.steps, device)
        set_dense(model, True)
        dense = measure(model, T, args.steps, device)
        rows.append((T, dsa, dense))
        print(f"T={T}: dsa {dsa}, dense {dense}", flush=True)
    kv_bytes(2)
    print(f"\n{'tokens':>8} | {'DSA s/step':>10} {'DSA GiB':>8} | {'dense s/step':>12} {'dense GiB':>9} | "
          f"{'time dense/DSA':>14} {'mem dense/DSA':>13}")
    for T, dsa, dense in rows:
        def cells(r):
            return ("OOM", "") if isinstance(r, str) else (f"{r[0]:.3f}", f"{r[1]:.1f}")
        ratio_t = ratio_m = "-"
        if not isinstance(dsa, str) and not isinstance(dense, str):
            ratio_t = f"{dense[0] / dsa[0]:.2f}x"
            ratio_m = f"{dense[1] / dsa[1]:.2f}x" if device.type == "cuda" else "-"
        (a, b), (c, d) = cells(dsa), cells(dense)
        print(f"{T:>8} | {a:>10} {b:>8} | {c:>12} {d:>9} | {ratio_t:>14} {ratio_m:>13}")


if __name__ == "__main__":
    main()
