"""train.compile: each block compiled in place computes what the eager block does, and the
state-dict keys (checkpoints, weight publishing) do not change."""

import copy

import pytest
import torch

from rlcli.models.config import ModelArgs
from rlcli.models.hf_io import build_model
from rlcli.ops import logprobs
from rlcli.ops.attention import ForwardContext, PackedCausalAttention
from rlcli.parallel.fsdp import apply_compile

TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
            max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5)


@pytest.fixture(autouse=True)
def eager_logprobs_after():
    yield
    logprobs.use_compiled(False)


def test_compiled_blocks_match_eager_in_output_gradients_and_keys():
    torch.manual_seed(0)
    eager = build_model(ModelArgs.from_hf(TINY), device="cpu", dtype=torch.float32)
    eager.init_weights(0)
    compiled = copy.deepcopy(eager)
    apply_compile(compiled)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    ids = torch.randint(0, 256, (1, 96))
    pos = torch.cat([torch.arange(40), torch.arange(56)])[None]  # two packed documents
    outs = []
    for model in (eager, compiled):
        h = model.hidden_states(ids, pos, ForwardContext(attn=PackedCausalAttention(pos)))
        (h.float() ** 2).mean().backward()
        outs.append(h)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_logprob_math_matches_eager(top_p=1.0):
    torch.manual_seed(0)
    h = torch.randn(300, 32, requires_grad=True)
    w = torch.randn(500, 32, requires_grad=True)
    targets = torch.randint(0, 500, (300,))
    results = []
    for compiled in (False, True):
        logprobs.use_compiled(compiled)
        h.grad = w.grad = None
        lp, entropy = logprobs.chunked_logprobs(h, w, targets, 0.7, 128, top_p)
        kept = torch.isfinite(lp)
        (lp[kept].sum() + 0.3 * entropy.sum()).backward()
        results.append((lp.detach(), entropy.detach(), h.grad, w.grad))
    for eager, fused in zip(*results):
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
