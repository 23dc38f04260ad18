"""q/k/v and gate/up stacked into one FP8 GEMM (rlcli.ops.fp8.siblings) compute what the separate
FP8 linears compute: same logits, gradients up to fp32 summation order (and the FP8 rounding of a
gradient that carries it), with fewer GEMMs; a member called alone falls back."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from rlcli.models import ModelArgs, build_model
from rlcli.ops.fp8.backends import EmulatedBackend
from rlcli.ops.fp8.convert import convert_to_fp8
from rlcli.ops.fp8.linear import FP8Linear, fp8_linear

LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 256, "intermediate_size": 384,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


class CountingBackend(EmulatedBackend):
    """The emulated backend, counting its GEMM calls."""

    def __init__(self) -> None:
        self.calls = 0

    def gemm(self, *a):
        self.calls += 1
        return super().gemm(*a)

    def gemm_1x128(self, *a):
        self.calls += 1
        return super().gemm_1x128(*a)


def _model(fuse: bool):
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf(LLAMA))
    model.init_weights(seed=0)
    be = CountingBackend()
    cfg = SimpleNamespace(backend="emulated", include=["*"], exclude=["*embed_tokens", "lm_head"], ue8m0=False,
                          fuse_siblings=["qkv", "gate_up"] if fuse else [])
    convert_to_fp8(model, cfg, backend=be)
    return model, be


def _step(model, ids):
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_stacked_siblings_equal_separate_fp8_linears_with_fewer_gemms():
    ids = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(1))
    (sep, be_sep), (fused, be_fused) = _model(False), _model(True)
    attn = fused.get_submodule("model.layers.0.self_attn")
    assert attn.q_proj.sibling_group is attn.v_proj.sibling_group is not None
    assert fused.get_submodule("model.layers.1.mlp").up_proj.sibling_group is not None
    assert attn.o_proj.sibling_group is None
    assert sep.get_submodule("model.layers.0.self_attn").q_proj.sibling_group is None
    opt = torch.optim.AdamW(sep.parameters(), lr=1e-2)
    for step in range(2):  # step 1: the stacked FP8 weight follows an update of the members' weights
        be_sep.calls = be_fused.calls = 0
        (ls, gs), (lf, gf) = _step(sep, ids), _step(fused, ids)
        torch.testing.assert_close(lf, ls, rtol=1e-5, atol=1e-5)
        for name in gs:
            # A stacked GEMM's input gradient sums over its members in another order; where that
            # gradient flows on into an FP8 linear its 1x128 quantization can round an element to the
            # neighbouring FP8 value (an e4m3 step is 1/8 of it), so bound the error by the gradient's
            # scale: up to 9.4e-3 of it measured with MKL/ATen on AVX-512, AVX2 and SSE4.2 kernels;
            # a wrong block or scale is off by the order of the gradient itself.
            bound = 3e-2 * gs[name].abs().max().item()
            torch.testing.assert_close(gf[name], gs[name], rtol=0, atol=bound, msg=f"{name} step {step}")
        assert (be_sep.calls, be_fused.calls) == (2 * 7 * 3, 2 * 4 * 3)  # fwd, dgrad, wgrad: 7 -> 4 a layer
        opt.step()
        with torch.no_grad():  # the same new weights in both (FP8 rounding would amplify any difference)
            for pf, ps in zip(fused.parameters(), sep.parameters()):
                pf.copy_(ps)
        sep.zero_grad(), fused.zero_grad()


def test_member_called_alone_or_out_of_order_runs_the_plain_path():
    model, be = _model(True)
    attn = model.get_submodule("model.layers.0.self_attn")
    x = torch.randn(2, 5, 256)
    for proj in (attn.k_proj, attn.v_proj):  # no leader call before: computed alone
        assert isinstance(proj, FP8Linear)
        torch.testing.assert_close(proj(x), fp8_linear(x, proj.weight, None, be), rtol=0, atol=0)
    q = attn.q_proj(x)  # the leader computes all three; k then comes from the stack, on the same tensor only
    torch.testing.assert_close(q, fp8_linear(x, attn.q_proj.weight, None, be), rtol=1e-6, atol=1e-6)
    other = x.clone()
    torch.testing.assert_close(attn.k_proj(other), fp8_linear(other, attn.k_proj.weight, None, be), rtol=0, atol=0)
    torch.testing.assert_close(attn.k_proj(x), fp8_linear(x, attn.k_proj.weight, None, be), rtol=1e-6, atol=1e-6)
