"""train.compile: each block compiled in place computes what the eager block does, and the
state-dict keys (checkpoints, weight publishing) do not change."""

import copy
from types import SimpleNamespace

import pytest
import torch

from rlcli.models.config import ModelArgs
from rlcli.models.hf_io import build_model
from rlcli.ops import logprobs
from rlcli.ops.attention import ForwardContext, PackedCausalAttention
from rlcli.ops.fp8.convert import convert_to_fp8
from rlcli.ops.prefix_tree import RowTree
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


FP8_MOE = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1], rope_theta=10000.0,
               max_position_embeddings=512, rms_norm_eps=1e-6)


def _fp8_frames_and_grads(layers: int, compile_blocks: bool, fp8: bool = True):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf({**FP8_MOE, "num_hidden_layers": layers}), device="cpu", dtype=torch.float32)
    model.init_weights(0)
    cfg = SimpleNamespace(backend="emulated", include=["*"], exclude=["*embed_tokens", "lm_head", "*.mlp.gate"],
                          ue8m0=False, fuse_siblings=["qkv"])
    if fp8:
        convert_to_fp8(model, cfg)
    if compile_blocks:
        apply_compile(model)
    ids = torch.randint(0, 256, (1, 96))
    pos = torch.cat([torch.arange(40), torch.arange(56)])[None]
    for _ in range(2):  # the second step hits the weight caches: no new frames either
        model.zero_grad()
        h = model.hidden_states(ids, pos, ForwardContext(attn=PackedCausalAttention(pos)))
        (h.float() ** 2).mean().backward()
    frames = torch._dynamo.utils.counters["frames"]["total"]
    return frames, h.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_fp8_blocks_match_eager_and_compile_once_for_any_depth():
    """FP8 linears and experts run outside the compiled graphs (their weight caches and sibling stacking are
    Python state): one break per call, and the frames after each break are shared by every layer, so a deep
    model compiles as many frames as a shallow one (tracing into them compiled new frames per layer until
    dynamo's recompile limit sent the rest of the model to eager)."""
    frames_2, _, _ = _fp8_frames_and_grads(2, compile_blocks=True)
    frames_4, h, grads = _fp8_frames_and_grads(4, compile_blocks=True)
    assert frames_4 == frames_2
    _, h_ref, grads_ref = _fp8_frames_and_grads(4, compile_blocks=False)
    _, _, grads_hp = _fp8_frames_and_grads(4, compile_blocks=False, fp8=False)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
    assert grads.keys() == grads_ref.keys() == grads_hp.keys()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    # The backward quantizes dy in 1x128 tiles: a last-bit difference in one element (compiled RMSNorm
    # backward) can move a tile's scale and re-round the whole tile, so compiled and eager FP8 gradients
    # differ by more than float noise; they must stay well inside FP8's own error against fp32.
    ratios = {n: rel(grads[n], grads_ref[n]) / rel(grads_ref[n], grads_hp[n]) for n in grads}
    assert max(ratios.values()) < 1.0, ratios
    assert sum(ratios.values()) / len(ratios) < 0.5, ratios


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


def _shared_prompt_rows(step: int) -> tuple[torch.Tensor, list[RowTree]]:
    """A row of two prompts with 2 and 3 completions each, completion lengths varying with ``step``:
    a different document structure every step, as in RL."""
    spans, parents, pos, start = [], [], [], 0
    for prompt_len, lens in ((11, (5 + step, 7)), (9, (4, 6 + 2 * step, 3))):
        root = len(spans)
        spans.append((start, start + prompt_len))
        parents.append(-1)
        pos += list(range(prompt_len))
        start += prompt_len
        for n in lens:
            spans.append((start, start + n))
            parents.append(root)
            pos += list(range(prompt_len, prompt_len + n))
            start += n
    return torch.tensor(pos)[None], [RowTree(spans, parents)]


def test_compiled_blocks_keep_attention_planning_out_of_the_graph():
    """Attention over packed rows plans on the host from the row's document structure, which changes every RL
    step: inside a compiled block that planning was traced (a recompile per new structure) and, on a CPU with
    shared-prompt rows, inductor generated a mask kernel g++ rejected (rl-train --compile died at its first RL
    step). Compiled and eager agree on shared-prompt rows, and a new structure compiles nothing new."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    eager = build_model(ModelArgs.from_hf(TINY), device="cpu", dtype=torch.float32)
    eager.init_weights(0)
    compiled = copy.deepcopy(eager)
    apply_compile(compiled)
    frames = []
    for step in range(3):
        pos, trees = _shared_prompt_rows(step)
        ids = torch.randint(0, 256, pos.shape)
        outs = []
        for model in (eager, compiled):
            model.zero_grad()
            h = model.hidden_states(ids, pos, ForwardContext(attn=PackedCausalAttention(pos, trees=trees)))
            (h.float() ** 2).mean().backward()
            outs.append(h)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert frames[2] == frames[1], frames
