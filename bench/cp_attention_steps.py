"""One context-parallel rank's attention, step after step: FlexAttention under --cp against cuDNN on the row.

What `rl-train --cp C` runs in each attention layer on CUDA, without the collectives: rank
--rank's queries (chunks r and 2C-1-r of the row), the whole row's keys and values, MLA's head
sizes by default (16 heads, q/k 192, v 128, bf16; --dtype float32 is what rl-train computes in
with its default model.dtype), through a
``rlcli.ops.document_attention.PackedCausalAttention`` built anew every step from that step's
row (as rl-train builds one per row), --layers layers each under activation checkpointing
(recomputed in the backward pass, as `train.activation_checkpointing = "full"` does). The
baseline is what `--cp 1` runs on the same row: every query, backend `auto` (cuDNN for rows of
one document); arm `flex-row` runs FlexAttention on every query (the mask and kernel without the
CP query subset). Per step and arm it prints the block-mask build, forward + backward, the graphs
torch.compile built during the step, the frames it gave up on (they run eagerly from then on),
whether FlexAttention warned that it ran unfused (materializing the scores), and the peak memory; then the median of the steps
after the first and the ratio CP / row (the CP rank does 1/C of the row's causal work: ~1/C
is the ideal).

    python bench/cp_attention_steps.py --seq 8192,16384,32768      # one GPU
    python bench/cp_attention_steps.py --smoke                     # CPU, tiny (sdpa for both arms)
"""

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlcli.ops.document_attention import PackedCausalAttention  # noqa: E402
from rlcli.parallel.context import cp_query_index  # noqa: E402
from rlcli.train.profile import compile_counts  # noqa: E402


def row_positions(seq: int, docs: int, gen: torch.Generator) -> torch.Tensor:
    """Position ids [1, seq] of ``docs`` documents of random lengths (one: the whole row)."""
    cuts = sorted(torch.randperm(seq - 1, generator=gen)[:docs - 1].add(1).tolist())
    bounds = [0, *cuts, seq]
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None]


def one_step(pos, index, layers, heads, dqk, dv, device, dtype, backend) -> dict:
    """Forward + backward of ``layers`` checkpointed attention calls on fresh inputs."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    T, S = (pos.shape[1] if index is None else index.numel()), pos.shape[1]
    q = torch.randn(1, T, heads, dqk, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, S, heads, dqk, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, S, heads, dv, device=device, dtype=dtype, requires_grad=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = compile_counts()
    from torch.nn.attention import flex_attention as fa
    getattr(fa, "_WARNINGS_SHOWN", set()).discard("flex_attention_performance")  # torch warns once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sync()
        t0 = time.perf_counter()
        attn = PackedCausalAttention(pos, backend=backend, query_index_T=index, device=device)
        if attn.backend == "flex":
            attn.block_mask()
        sync()
        t1 = time.perf_counter()
        loss = 0
        for layer in range(layers):
            out = checkpoint(lambda a, b, c, i=layer: attn(i, a * 1.0, b, c, dqk ** -0.5), q, k, v,
                             use_reentrant=False, preserve_rng_state=False)
            loss = loss + out.float().square().mean()
        loss.backward()
        sync()
        t2 = time.perf_counter()
    after = compile_counts()
    return {"backend": attn.backend, "mask_ms": (t1 - t0) * 1e3, "step_ms": (t2 - t1) * 1e3,
            "graphs": after["compile_graphs"] - before["compile_graphs"],
            "fallbacks": after["compile_fallbacks"] - before["compile_fallbacks"],
            "unfused": any("without torch.compile" in str(w.message) for w in caught),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default="8192,16384,32768", help="row lengths, comma separated")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0, help="the CP rank whose queries are run")
    ap.add_argument("--docs", type=int, default=1, help="documents per row (new random cuts every step)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--qk-dim", type=int, default=192, help="MLA: 128 nope + 64 rope")
    ap.add_argument("--v-dim", type=int, default=128)
    ap.add_argument("--arms", default="cp,row", help="cp: the CP rank's queries (flex on CUDA); row: all queries "
                    "(cuDNN on CUDA); flex-row: all queries through FlexAttention")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="q/k/v dtype (default: bfloat16 on CUDA, float32 on a CPU); rl-train computes in model.dtype")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny")
    a = ap.parse_args()
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if a.smoke:
        a.seq, a.layers, a.heads, a.qk_dim, a.v_dim, a.steps = "256,512", 2, 2, 24, 16, 3
    print(f"# {device.type} {torch.cuda.get_device_name() if device.type == 'cuda' else ''} torch {torch.__version__}; "
          f"cp {a.cp} rank {a.rank}, {a.docs} document(s) per row, {a.layers} checkpointed layers, {a.heads} heads, "
          f"q/k {a.qk_dim} v {a.v_dim}, {dtype}", flush=True)
    gen = torch.Generator().manual_seed(0)
    summary = []
    for seq in (int(s) for s in a.seq.split(",")):
        medians = {}
        for arm in a.arms.split(","):
            index = cp_query_index(seq, a.rank, a.cp) if arm == "cp" else None
            backend = "flex" if arm == "flex-row" else "auto"
            steps = []
            for step in range(1, a.steps + 1):
                try:
                    r = one_step(row_positions(seq, a.docs, gen), index, a.layers, a.heads, a.qk_dim, a.v_dim,
                                 device, dtype, backend)
                except Exception as e:  # noqa: BLE001 -- report and go on to the next arm
                    print(f"seq {seq} {arm}: step {step} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    break
                steps.append(r)
                print(f"seq {seq:6d} {arm:3s} ({r['backend']}) step {step}: mask {r['mask_ms']:9.1f} ms  "
                      f"fwd+bwd {r['step_ms']:10.1f} ms  graphs {r['graphs']:.0f}  fallbacks {r['fallbacks']:.0f}  "
                      f"unfused {r['unfused']}  peak {r['peak_gib']:.1f} GiB", flush=True)
            if len(steps) > 1:
                medians[arm] = statistics.median(s["mask_ms"] + s["step_ms"] for s in steps[1:])
        summary.append((seq, medians))
    arms = a.arms.split(",")
    print(f"{'seq':>7} " + " ".join(f"{arm + ' ms':>12}" for arm in arms) + f" {'cp / row':>9}  (ideal ~1/{a.cp})")
    for seq, medians in summary:
        ratio = medians["cp"] / medians["row"] if "cp" in medians and "row" in medians else float("nan")
        print(f"{seq:>7} " + " ".join(f"{medians.get(arm, float('nan')):>12.1f}" for arm in arms) + f" {ratio:>9.2f}")


if __name__ == "__main__":
    main()
