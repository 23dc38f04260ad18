"""Token logprobs and entropy from hidden states, chunked over tokens, with recomputation.

The naive path (``log_softmax(lm_head(h).float())``) keeps fp32 ``[N, V]`` logits, their
log-softmax and, for an entropy bonus, ``exp`` of it alive for backward: at 131k tokens and
a 150k vocabulary that is ~80 GB per tensor. Here the LM head runs on ``chunk`` tokens at a
time; forward keeps only per-token scalars (logprob, entropy, logsumexp), and backward
recomputes each chunk's logits (or, with ``keep_logits``, reads forward's) and turns them
straight into the gradients of the hidden states and of the LM-head weight. The largest
temporary is one chunk's fp32 logits. When the tokens fit one chunk, backward's matmuls
write the gradients directly (no fp32 accumulators).

Gradients (``z`` = logits / T, ``p`` = softmax(z), ``lp`` = z[target] - logsumexp(z),
``H`` = -sum p log p):  d lp / d z = onehot(target) - p,  d H / d z = -p (log p + H).
The entropy gets a gradient only when the loss uses it; otherwise it costs no backward work.

Per chunk, everything after the LM-head matmul is elementwise work and reductions over a
``[chunk, V]`` block (cast, scale, logsumexp, exp, the gradient). Eager torch runs each as
its own pass over that block; after ``use_compiled(True)`` (``train.compile``) it runs as
one compiled function per direction (forward statistics, backward logit gradient), which
fuses those passes.
"""

import torch

from rlcli.ops.batch_invariant import row_logsumexp, row_sum, rows_mm
from rlcli.ops.sampling import top_p_keep


def _nucleus(z_CV: torch.Tensor, logp_CV: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep mask, logsumexp of ``z`` over it) for the top-p nucleus (the engine's ``top_p_keep``)."""
    keep = top_p_keep(logp_CV.exp(), top_p)
    return keep, row_logsumexp(z_CV.masked_fill(~keep, float("-inf")))


def _chunk_stats(zraw_CV, targets_C, inv_temp: float, top_p: float = 1.0):
    """(logprob of the targets, entropy, logsumexp) of one chunk from its raw logits, in five
    passes over the chunk: max, shift, exp, sum, and one dot product of the exponentials with
    the shifted logits for the entropy (``H = log S - E_p[z - max]``, ``S`` the sum: no
    cancellation against the max)."""
    z = zraw_CV.float() * inv_temp if inv_temp != 1.0 else zraw_CV.float()
    m = z.amax(dim=-1, keepdim=True)
    d = z - m
    e = d.exp()
    sum_e = row_sum(e)
    log_s = sum_e.log()
    lse = m[:, 0] + log_s
    entropy = log_s - torch.linalg.vecdot(e, d) / sum_e  # of the full distribution, as the bonus wants
    lp = z.gather(1, targets_C[:, None])[:, 0] - lse
    if top_p < 1:
        logp = z - lse[:, None]
        keep, lse_keep = _nucleus(z, logp, top_p)
        lp = (z.gather(1, targets_C[:, None])[:, 0] - lse_keep).masked_fill(
            ~keep.gather(1, targets_C[:, None])[:, 0], float("-inf"))  # ratio 0: masked
    return lp, entropy, lse


def _chunk_grad(zraw_CV, targets_C, grad_lp_N, grad_entropy_N, entropy_N, lse_N, s: int, chunk: int,
                inv_temp: float, top_p: float) -> torch.Tensor:
    """d loss / d logits of one chunk, from forward's logsumexp: ``p`` in two passes, the
    logprob's gradient written into it in place; computed in fp32, returned in the logits'
    dtype (the matmuls' input; compiled, the cast is part of the fused kernel)."""
    z = zraw_CV.float() * inv_temp if inv_temp != 1.0 else zraw_CV.float()
    lse = lse_N[s:s + chunk, None]
    p = (z - lse).exp_()
    t = targets_C[:, None]
    g_z = None
    if grad_entropy_N is not None:
        g = grad_entropy_N[s:s + chunk, None].float()
        g_z = p * (z - lse + entropy_N[s:s + chunk, None]) * -g
    if grad_lp_N is not None:
        g = grad_lp_N[s:s + chunk, None].float()
        # d lp / d z = onehot(target) - p over the distribution lp is taken under (the nucleus
        # when top_p < 1: softmax renormalized over the kept tokens, 0 elsewhere).
        if top_p >= 1:
            g_z = p.mul_(-g) if g_z is None else g_z.sub_(p * g)
            g_z.scatter_add_(1, t, g)
        else:
            keep, lse_keep = _nucleus(z, z - lse, top_p)
            g_lp = (z - lse_keep[:, None]).exp_().mul_(keep).mul_(-g)
            g_lp.scatter_add_(1, t, g * keep.gather(1, t))
            g_z = g_lp if g_z is None else g_z.add_(g_lp)
    return (g_z.mul_(inv_temp) if inv_temp != 1.0 else g_z).to(zraw_CV.dtype)


_compiled: dict[str, object] = {}


def use_compiled(enabled: bool = True) -> None:
    """Run the per-chunk math compiled, or eager again (see module docstring)."""
    if enabled and not _compiled:
        _compiled["stats"] = torch.compile(_chunk_stats, dynamic=True)
        _compiled["grad"] = torch.compile(_chunk_grad, dynamic=True)
    elif not enabled:
        _compiled.clear()


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, weight_VD, targets_N, temperature: float, chunk: int, top_p: float, keep_logits: bool):
        N = h_ND.shape[0]
        lp, entropy, lse = (h_ND.new_empty(N, dtype=torch.float32) for _ in range(3))
        kept = []
        with torch.no_grad():
            stats = _compiled.get("stats", _chunk_stats)
            for s in range(0, N, chunk):
                z = rows_mm(h_ND[s:s + chunk], weight_VD.T)  # a chunk of few rows: the big-batch kernel
                lp[s:s + chunk], entropy[s:s + chunk], lse[s:s + chunk] = stats(
                    z, targets_N[s:s + chunk], 1.0 / temperature, top_p)
                if keep_logits:
                    kept.append(z)
        ctx.save_for_backward(h_ND, weight_VD, targets_N, entropy, lse, *kept)
        ctx.temperature, ctx.chunk, ctx.top_p = temperature, chunk, top_p
        ctx.set_materialize_grads(False)
        return lp, entropy

    @staticmethod
    def backward(ctx, grad_lp_N, grad_entropy_N):
        h_ND, weight_VD, targets_N, entropy_N, lse_N, *kept = ctx.saved_tensors
        inv_temp, chunk = 1.0 / ctx.temperature, ctx.chunk
        grad = _compiled.get("grad", _chunk_grad)

        def logits(i: int, h: torch.Tensor) -> torch.Tensor:  # forward's, or recomputed
            return kept[i] if kept else rows_mm(h, weight_VD.T)

        if h_ND.shape[0] <= chunk and (grad_lp_N is not None or grad_entropy_N is not None):
            # One chunk: the matmuls write the gradients, no fp32 accumulators.
            g_z = grad(logits(0, h_ND), targets_N, grad_lp_N, grad_entropy_N, entropy_N, lse_N, 0, chunk, inv_temp,
                       ctx.top_p)
            return (g_z @ weight_VD if ctx.needs_input_grad[0] else None,
                    g_z.T @ h_ND if ctx.needs_input_grad[1] else None, None, None, None, None, None)
        grad_h = torch.zeros_like(h_ND) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) \
            if ctx.needs_input_grad[1] else None
        if grad_lp_N is None and grad_entropy_N is None:
            return grad_h, grad_w, None, None, None, None, None
        for i, s in enumerate(range(0, h_ND.shape[0], chunk)):
            h = h_ND[s:s + chunk]
            g_z = grad(logits(i, h), targets_N[s:s + chunk], grad_lp_N, grad_entropy_N, entropy_N, lse_N, s,
                       chunk, inv_temp, ctx.top_p)
            if grad_h is not None:
                grad_h[s:s + chunk] = g_z @ weight_VD
            if grad_w is not None:
                grad_w.addmm_(g_z.T.float(), h.float()) if weight_VD.dtype == torch.float32 \
                    else grad_w.add_((g_z.T @ h).float())
        return grad_h, None if grad_w is None else grad_w.to(weight_VD.dtype), None, None, None, None, None


def token_logprobs_of(logits_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float,
                      top_p: float = 1.0) -> torch.Tensor:
    """fp32 logprob ``[C]`` of ``targets_C`` under ``softmax(logits / T)`` (the nucleus when
    ``top_p < 1``), computed exactly as :func:`chunked_logprobs` does: the inference engine
    reports these under ``model.batch_invariant`` so that both sides round alike."""
    return _chunk_stats(logits_CV, targets_C.long(), 1.0 / temperature, top_p)[0]


def chunked_logprobs(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                     temperature: float = 1.0, chunk: int = 1024, top_p: float = 1.0, keep_logits: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(logprob of targets_N, entropy)``, both ``[N]``, under ``softmax(hidden @ weight.T / T)``.

    With ``top_p < 1`` the logprob is under the nucleus the engine sampled from (the same
    truncation, renormalized; -inf outside it); the entropy stays that of the full distribution.
    Differentiable in ``hidden_ND`` and ``weight_VD``; peak extra memory is one
    ``[chunk, V]`` fp32 block (see module docstring). ``keep_logits`` keeps every chunk's
    logits (``[N, V]`` in the weight's dtype) from forward to backward instead of recomputing
    them: one LM-head matmul less, for that much memory until backward.
    """
    return _ChunkedLogprobs.apply(hidden_ND, weight_VD, targets_N.long(), float(temperature), int(chunk),
                                  float(top_p), bool(keep_logits))
