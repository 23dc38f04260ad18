"""The engine's maskless prefill attention (its CUDA path) equals the dense-masked reference:
a whole prompt and chunks after cached KV, grouped and ungrouped heads, MLA-like value dims."""

import pytest
import torch
import torch.nn.functional as F

from rlcli.ops.attention import prefill_attention


def reference(q, k, v, scale):
    t, s = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)  # query j sits at position s - t + j
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("t,s", [(37, 37), (16, 53), (2, 40)])
@pytest.mark.parametrize("hq,hkv,dqk,dv", [(8, 2, 16, 16), (4, 4, 24, 16)])
def test_prefill_attention_matches_the_masked_reference(t, s, hq, hkv, dqk, dv):
    g = torch.Generator().manual_seed(t * 100 + s)
    q = torch.randn(1, hq, t, dqk, generator=g)
    k = torch.randn(1, hkv, s, dqk, generator=g)
    v = torch.randn(1, hkv, s, dv, generator=g)
    got = prefill_attention(q, k, v, 0.3)
    torch.testing.assert_close(got, reference(q, k, v, 0.3), rtol=0, atol=2e-6)
