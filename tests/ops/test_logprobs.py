import pytest
import torch

from rlcli.ops.logprobs import chunked_logprobs


def _naive(h, w, t, temperature):
    logp = torch.log_softmax((h @ w.T).float() / temperature, -1)
    return logp.gather(1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("entropy_coef,keep_logits", [(0.0, False), (0.3, False), (0.3, True)])
def test_chunked_logprobs_match_the_full_vocab_computation(entropy_coef, keep_logits):
    torch.manual_seed(0)
    N, D, V = 37, 16, 50
    h = torch.randn(N, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    t = torch.randint(0, V, (N,))
    grads = []
    for fn in (lambda: chunked_logprobs(h, w, t, 0.7, chunk=8, keep_logits=keep_logits), lambda: _naive(h, w, t, 0.7)):
        lp, ent = fn()
        (lp.sin().sum() + entropy_coef * ent.sum()).backward()
        grads.append((lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()))
        h.grad = w.grad = None
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()


def test_no_full_vocab_tensor_of_the_batch_is_kept_for_backward():
    N, D, V = 64, 8, 1000
    h = torch.randn(N, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        lp, ent = chunked_logprobs(h, w, torch.randint(0, V, (N,)), 1.0, chunk=16)
    (lp.sum() + ent.sum()).backward()
    assert saved and max(saved) < N * V  # the naive path saves [N, V] logits (and more)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        _naive(h, w, torch.randint(0, V, (N,)), 1.0)
    assert max(saved) >= N * V  # the check above can fail


@pytest.mark.parametrize("top_p", [0.7, 0.95])
def test_top_p_logprobs_match_the_trainers_nucleus(top_p):
    """With top_p < 1 the chunked path computes the truncated, renormalized logprob the engine
    sampled from (and -inf outside the nucleus), with the same gradients as the full-vocab path."""
    from rlcli.train.loss import token_logprobs

    torch.manual_seed(0)
    N, D, V = 64, 16, 50
    h = torch.randn(N + 1, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    ids = torch.randint(0, V, (1, N + 1))
    ref, _ = token_logprobs((h @ w.T)[None], ids, 0.9, top_p)
    ref = ref[0, 1:]
    lp, _ = chunked_logprobs(h[:-1], w, ids[0, 1:], 0.9, chunk=5, top_p=top_p)
    kept = torch.isfinite(ref)
    assert 0 < kept.sum() < N and torch.equal(torch.isfinite(lp), kept)
    assert torch.allclose(lp[kept], ref[kept], atol=1e-5)
    weights = torch.randn(N)
    got = torch.autograd.grad((lp[kept] * weights[kept]).sum(), (h, w))
    want = torch.autograd.grad((ref[kept] * weights[kept]).sum(), (h, w))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_one_chunk_and_many_chunks_give_the_same_gradients():
    """chunk >= N takes the single-chunk backward (bf16 matmuls write the gradients, no fp32
    accumulators); both agree with each other and with the fp32 full-vocab path to bf16 precision."""
    torch.manual_seed(1)
    N, D, V = 37, 16, 50
    h0, w0 = torch.randn(N, D) * 0.5, torch.randn(V, D) * 0.5
    t = torch.randint(0, V, (N,))
    grads = []
    for chunk in (8, 64):
        h, w = h0.bfloat16().requires_grad_(), w0.bfloat16().requires_grad_()
        lp, ent = chunked_logprobs(h, w, t, 0.7, chunk=chunk)
        (lp.sin().sum() + 0.3 * ent.sum()).backward()
        assert h.grad.dtype == w.grad.dtype == torch.bfloat16
        grads.append((h.grad.float(), w.grad.float()))
    hf, wf = h0.bfloat16().float().requires_grad_(), w0.bfloat16().float().requires_grad_()
    lp, ent = _naive(hf, wf, t, 0.7)
    (lp.sin().sum() + 0.3 * ent.sum()).backward()
    for got in grads:
        for g, ref in zip(got, (hf.grad, wf.grad)):
            assert (g - ref).norm() / ref.norm() < 2e-2, (g - ref).norm() / ref.norm()
    for a, b in zip(*grads):
        assert (a - b).norm() / b.norm() < 1e-2
