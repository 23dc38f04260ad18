"""The sampler's draw in one Triton kernel (:func:`rlcli.ops.sampling.sample` on CUDA without top-p).

In torch the draw is a chain over the whole ``[S, V]`` logits: the fp32 copy, the temperature's
division, ``log_softmax``, ``exp``, a float64 ``cumsum`` and ``searchsorted``; each reads and writes
every row, about 2 GB of memory traffic at 256 rows of Qwen3's 151,936 tokens (1.1 ms of a graphed
decode step on an H200, docs/benchmarks.md). Here one program owns a row and reads its logits four
times, writing nothing but the token and its logprob:

1. the max of ``logits / T`` (and, for a greedy row, ``T = 0``, the argmax of the logits, first
   index on ties, as ``torch.argmax``);
2. ``lse``, the log of the sum of ``exp(logits / T - max)``;
3. the row's total of ``p = exp(logits / T - max - log(sum))`` in float64;
4. the token: the number of positions whose cumulative ``p`` (float64) is at most ``u`` times the
   total, which is the first position past it (``searchsorted(..., right=True)``), at most ``V - 1``.

It computes what the torch chain computes, in another order of summation (the fp32 sum of the
exponentials, the float64 cumulative sums); a token can differ only where ``u`` falls within that
rounding of a boundary between two tokens. The logprob is ``logits / T - max - log(sum)`` at the
token (``T = 1`` for a greedy row), as ``log_softmax``'s.
"""

import torch

import triton
import triton.language as tl

BLOCK = 4096  # vocabulary positions per iteration


@triton.jit
def _sample_kernel(LOGITS, TEMP, U, TOKENS, LOGPROBS, V, s_l, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    base = LOGITS + row * s_l
    t = tl.load(TEMP + row)
    greedy = t <= 0
    t = tl.where(greedy, 1.0, t)
    # 1: the max of logits / T, and the argmax (first on ties)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int64)
    for c in range(0, V, BLOCK):
        x = tl.load(base + c + cols, mask=c + cols < V, other=float("-inf")).to(tl.float32) / t
        better = x > best  # strictly: an earlier block keeps a tie
        best_at = tl.where(better, c + cols, best_at)
        best = tl.maximum(best, x)
    mx = tl.max(best, axis=0)
    arg = tl.min(tl.where(best == mx, best_at, V), axis=0)  # the first position holding the max
    # 2: the log of the sum of exponentials
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(0, V, BLOCK):
        x = tl.load(base + c + cols, mask=c + cols < V, other=float("-inf")).to(tl.float32) / t
        acc += tl.exp(x - mx)
    log_sum = tl.log(tl.sum(acc, axis=0))
    # 3: the total of the probabilities in float64 (the CDF's last entry)
    total = tl.zeros([BLOCK], tl.float64)
    for c in range(0, V, BLOCK):
        x = tl.load(base + c + cols, mask=c + cols < V, other=float("-inf")).to(tl.float32) / t
        total += tl.exp((x - mx) - log_sum).to(tl.float64)
    target = tl.load(U + row) * tl.sum(total, axis=0)
    # 4: positions whose cumulative probability is at most the target
    below = tl.zeros([BLOCK], tl.int64)
    run = tl.zeros([], tl.float64)
    for c in range(0, V, BLOCK):
        x = tl.load(base + c + cols, mask=c + cols < V, other=float("-inf")).to(tl.float32) / t
        p = tl.exp((x - mx) - log_sum).to(tl.float64)
        cdf = run + tl.cumsum(p, axis=0)
        below += ((cdf <= target) & (c + cols < V)).to(tl.int64)
        run += tl.sum(p, axis=0)
    token = tl.where(greedy, arg, tl.minimum(tl.sum(below, axis=0), V - 1))
    x_tok = tl.load(base + token).to(tl.float32) / t
    tl.store(TOKENS + row, token)
    tl.store(LOGPROBS + row, (x_tok - mx) - log_sum)


def sample_rows(logits_SV: torch.Tensor, temperature_S: torch.Tensor,
                u_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [S] (int64) and their logprobs [S] (float32): each row drawn from ``softmax(logits /
    T)`` at its uniform ``u`` (float64), a row of ``T <= 0`` greedily."""
    S, V = logits_SV.shape
    logits = logits_SV if logits_SV.stride(-1) == 1 else logits_SV.contiguous()
    tokens = torch.empty(S, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(S, dtype=torch.float32, device=logits.device)
    if S:
        _sample_kernel[(S,)](logits, temperature_S.float().contiguous(), u_S.reshape(S).contiguous(), tokens,
                             logprobs, V, logits.stride(0), BLOCK=BLOCK, num_warps=8)
    return tokens, logprobs
