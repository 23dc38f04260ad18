"""rlcli.infer.cuda_graphs: the native engine's decode steps replayed as CUDA graphs.

On CUDA the graphs are captured and replayed. Without CUDA, where Triton's interpreter works,
``test_under_the_interpreter`` runs this file in a child process on CPU tensors, where
:class:`DecodeGraphs` runs the same forward over the same static buffers without capturing (the
padding, the scratch block and the span counts are checked there too). Which batch sizes get a
graph and which engines cannot be graphed are checked everywhere.
"""

import os
from types import SimpleNamespace

import pytest
import torch

import interpreter
from tiny import write_tiny_model
from rlcli.infer import cuda_graphs
from rlcli.models import load_model

ON_CPU = os.environ.get("RLCLI_PAGED_DECODE_ON_CPU") == "1" and interpreter.ACTIVE
DEVICE = "cuda" if torch.cuda.is_available() else "cpu" if ON_CPU else None


def _device() -> str:
    if DEVICE is None:
        pytest.skip("needs CUDA; without it test_under_the_interpreter runs these")
    try:
        from rlcli.ops import paged_decode  # noqa: F401
    except (ImportError, OSError):
        pytest.skip("triton does not import")
    return DEVICE


@pytest.mark.skipif(DEVICE is not None, reason="the graphs run here directly")
def test_under_the_interpreter():
    interpreter.run_child_or_skip(__file__, {"RLCLI_PAGED_DECODE_ON_CPU": "1"})


MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, norm_topk_prob=True)
# DeepSeek-V3's layout: MLA in every layer, a dense first layer and an MoE second (grouped routing).
MLA = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=4,
           moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
           first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5)
# DeepSeek-V3.2's sparse attention on the same layout: a lightning indexer choosing 5 tokens a query.
DSA = dict(MLA, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_topk=5, index_n_heads=8,
           index_head_dim=16)
ARCHS = {"dense": {}, "moe": MOE, "mla": MLA, "dsa": DSA}
# rl-infer --fp8: FP8 weights and block scales in the linears (the router, embeddings and head stay).
FP8 = SimpleNamespace(enabled=True, backend="auto", include=["*"], exclude=["*embed_tokens", "lm_head", "*.mlp.gate"],
                      ue8m0=False)


def _fp8_model(path, device: str, dtype: torch.dtype):
    return load_model(path, device=device, dtype=dtype, seed=3, fp8=FP8, fp8_storage=True).eval()


def test_capture_sizes():
    assert cuda_graphs.capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 32]
    assert cuda_graphs.capture_sizes(256)[-2:] == [240, 256]
    assert cuda_graphs.capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]  # max_num_seqs always has one
    assert cuda_graphs.capture_sizes(3) == [1, 2, 3]
    assert cuda_graphs.capture_sizes(4096)[-1] == cuda_graphs.MAX_SIZE  # larger steps run eagerly


def test_what_cannot_be_graphed_is_named(monkeypatch, tmp_path):
    dense = load_model(write_tiny_model(tmp_path / "d"), seed=0)
    moe = load_model(write_tiny_model(tmp_path / "m", **MOE), seed=0)
    mla = load_model(write_tiny_model(tmp_path / "mla", **MLA), seed=0)
    dsa = load_model(write_tiny_model(tmp_path / "dsa", **DSA), seed=0)

    def why(model, **kw):
        return cuda_graphs.unsupported(model, **{"paged_decode": True, "batch_invariant": False, "role": "mixed", **kw})

    try:
        from rlcli.ops import paged_decode  # noqa: F401
        assert why(dense) is None
    except (ImportError, OSError):
        assert "Triton" in why(dense)
    monkeypatch.setattr(cuda_graphs, "_grouped_kernel", lambda device, dtype: False)  # experts one by one
    assert "MoE" in why(moe)
    monkeypatch.setattr(cuda_graphs, "_grouped_kernel", lambda device, dtype: True)
    assert why(moe) == why(dense) == why(mla)
    from rlcli.ops import mla as mla_ops
    if mla_ops.dsa_decodes_in_place(dsa.args, next(dsa.parameters())):  # (CUDA with Triton) on the paged kernels
        assert why(dsa) == why(mla)
    else:
        assert "DSA's decodes need its Triton kernels" in why(dsa)
    if why(dense) is None:  # (Triton imports) DeepSeek-V3's latent width: the kernel's tiles fit bf16, not fp32
        wide = load_model(write_tiny_model(tmp_path / "wide", **dict(MLA, kv_lora_rank=512, qk_rope_head_dim=64)),
                          seed=0)
        assert "do not fit" in why(wide) and why(wide.to(torch.bfloat16)) is None
    # FP8 linears are graphed (their weights and scales are parameters and buffers); FP8 experts only
    # where their grouped GEMMs read the offsets on the device (DeepGEMM's), not the loop over experts.
    assert why(_fp8_model(write_tiny_model(tmp_path / "f"), "cpu", torch.float32)) == why(dense)
    fp8_moe = _fp8_model(write_tiny_model(tmp_path / "fm", **MOE), "cpu", torch.float32)
    assert "FP8 MoE experts on the emulated GEMM backend" in why(fp8_moe)
    from rlcli.ops.fp8.backends import EmulatedBackend
    monkeypatch.setattr(EmulatedBackend, "grouped_on_device", True)
    assert why(fp8_moe) == why(moe)
    assert "batch_invariant" in why(dense, batch_invariant=True)
    assert "paged_decode" in why(dense, paged_decode=False)
    assert "prefill" in why(dense, role="prefill")


def test_the_engine_says_how_it_decodes(tmp_path):
    """rl-infer logs NativeEngine.decode_mode on a GPU: graphs, or eager and why; fused kernels, or
    unfused and why."""
    from rlcli.infer.engine import NativeEngine

    model = load_model(write_tiny_model(tmp_path / "m"), seed=0)
    off = NativeEngine(model, eos_token_ids=[], max_model_len=64, cuda_graphs=False, fused_kernels=False)
    assert off.graphs is None
    assert off.decode_mode == "eager (off (infer.engine.cuda_graphs)), unfused (off (infer.engine.fused_kernels))"
    assert not any(type(m).__name__.startswith("Fused") for m in model.modules())
    if not torch.cuda.is_available():
        mode = NativeEngine(model, eos_token_ids=[], max_model_len=64, fused_kernels=True).decode_mode
        assert mode.startswith("eager (not on CUDA), ")
        assert mode.endswith("fused kernels" if ON_CPU else "unfused (not on CUDA)")


def test_a_failed_capture_leaves_the_engine_decoding_eagerly(monkeypatch, tmp_path):
    """A graph capture that raises (an operation on a path unsupported() let through that a graph cannot
    hold, e.g. a host sync) does not take the engine down: it decodes eagerly, and decode_mode names
    the error (rl-infer logs it)."""
    from rlcli.infer import model_runner
    from rlcli.infer.engine import NativeEngine
    from rlcli.protocol import GenerateRequest, SamplingParams

    class Failing(cuda_graphs.DecodeGraphs):
        def capture(self):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    model = load_model(write_tiny_model(tmp_path / "m"), seed=0)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, fused_kernels=False)
    monkeypatch.setattr(model_runner, "DecodeGraphs", Failing)
    engine.runner.graphs_off = None  # as on a GPU where the model passes unsupported()
    engine.runner.capture_graphs()
    assert engine.graphs is None
    assert engine.decode_mode.startswith("eager (capture failed: RuntimeError: CUDA error: operation not permitted "
                                         "when stream is capturing), ")
    engine.add_request(GenerateRequest(request_id="r", prompt_ids=[1, 2, 3],
                                       sampling=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
    out = []
    while engine.has_work():
        out += engine.step()
    assert len(out[-1].completions[0].token_ids) == 4


@torch.no_grad()
def test_the_weight_fingerprint_moves_with_weights_only(tmp_path):
    """refresh() captures again only when a load moved a weight's storage. An MoE's load-balance
    counts (num_tokens_per_expert, a new tensor after every eager forward) are not a weight: counted,
    they made every weight load recapture every graph (found on an H100, thirty-second session)."""
    model = load_model(write_tiny_model(tmp_path / "m", **MOE)).eval()
    caches = [tuple(torch.zeros(5, 8, heads, dim) for heads, dim in spec) for spec in model.kv_cache_spec()]
    graphs = cuda_graphs.DecodeGraphs(model, caches, block_size=8, max_model_len=32, max_num_seqs=2, scratch_block=4)
    before = graphs._weights()
    for _ in range(2):
        model(torch.tensor([[1, 2, 3]]))
    assert any(m.num_tokens_per_expert is not None for m in graphs.moe)
    model.load_state_dict(load_model(tmp_path / "m", seed=1).state_dict())  # copied in place
    assert graphs._weights() == before
    p = model.get_parameter("model.layers.0.mlp.experts.w_up")
    p.data = p.data.clone()  # a load that rebinds a parameter (a collective receive's first)
    assert graphs._weights() != before


@pytest.mark.parametrize("arch", sorted(ARCHS) + ["fp8", "fp8-moe"])
@torch.no_grad()
def test_replayed_decodes_match_the_eager_forward(arch, monkeypatch, tmp_path):
    """Three decodes (contexts of 1, 17 and 1,100 keys: the long one split in two on an H100's 132
    SMs) replayed at size 4: the logits (and an MoE's routes) of the eager paged forward of the same
    three plus the padding row, the same keys and values written to their slots, the padding row's
    only in the scratch block. MLA attends in latent form (one cache tensor per layer); DSA chooses
    its tokens through the paged indexer kernel (its keys in a second cache tensor). The MoE
    models and the FP8 ones (FP8 weights and scales, rl-infer --fp8) run in bf16 on CUDA (torch's
    grouped GEMM; FP8 experts need DeepGEMM's). Then other weights are loaded in place (a storage
    kept, so no capture again; FP8 experts quantized again into the blocks the graphs read) and the
    same holds with them."""
    device = _device()
    from rlcli.ops import paged_decode
    from rlcli.ops.attention import ForwardContext, PagedAttention, PagedAttentionMetadata, RoutingContext

    monkeypatch.setattr(paged_decode, "_num_sms", lambda device: 132)
    if device == "cpu":  # DSA's Triton kernels under the interpreter (on CUDA they are the default)
        from rlcli.ops import mla as mla_ops
        monkeypatch.setattr(mla_ops, "TRITON", True)
    fp8 = arch.startswith("fp8")
    config = write_tiny_model(tmp_path / "m", **(MOE if arch == "fp8-moe" else ARCHS.get(arch, {})))
    moe = load_model(config).args.is_moe
    dtype = torch.bfloat16 if (moe or fp8) and device == "cuda" else torch.float32

    def model_of(seed: int) -> torch.nn.Module:
        if fp8:
            return load_model(config, device=device, dtype=dtype, seed=seed, fp8=FP8, fp8_storage=True).eval()
        return load_model(config, seed=seed).to(device, dtype).eval()

    model = model_of(3)
    if arch == "fp8-moe" and device == "cuda":  # (on CPU the same forward runs without capture)
        graphs_off = cuda_graphs.unsupported(model, paged_decode=True, batch_invariant=False, role="mixed")
        if graphs_off is not None:
            pytest.skip(graphs_off)
    a, bs, num_blocks = model.args, 8, 160
    g = torch.Generator().manual_seed(0)
    caches = [tuple(torch.randn(num_blocks + 1, bs, heads, dim, generator=g).to(device, dtype) for heads, dim in spec)
              for spec in model.kv_cache_spec()]
    graphs = cuda_graphs.DecodeGraphs(model, caches, block_size=bs, max_model_len=1200, max_num_seqs=6,
                                      scratch_block=num_blocks)
    assert graphs.sizes == [1, 2, 4, 6]
    assert graphs.split_counts(4) == [1, 2]  # 1,200 keys hold two spans of 512
    if not graphs.eager:
        graphs.capture()
        assert set(graphs.graphs) == {(s, n) for s in graphs.sizes for n in graphs.split_counts(s)}
    lens = [1, 17, 1100]
    owned = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = torch.full((3, -(-max(lens) // bs)), -1, dtype=torch.int64), 0
    for i, n in enumerate(lens):
        tables[i, :-(-n // bs)] = torch.tensor(owned[at:at - (-n // bs)])
        at += -(-n // bs)
    ids = torch.tensor([5, 9, 200])
    pos = torch.tensor(lens) - 1
    slots = tables[torch.arange(3), pos // bs] * bs + pos % bs
    tol = 1e-5 if dtype == torch.float32 else 1e-2

    def check() -> torch.Tensor:
        before = [[c.clone() for c in layer] for layer in caches]
        logits, routes = graphs.run(ids.numpy(), pos.numpy(), slots.numpy(), lens, tables.numpy())
        logits, routes = logits.clone(), routes.clone() if routes is not None else None
        assert (routes is not None) == moe
        graphed = [[c.clone() for c in layer] for layer in caches]
        for layer, saved in zip(caches, before):  # the eager forward writes the same slots again
            for c, s in zip(layer, saved):
                c.copy_(s)
        # The eager reference: the same four rows, the padding row as the graph's (token 0 at position 0,
        # its key in the scratch block), so every kernel sees the shapes the graph's did.
        pad_tables = torch.full((4, tables.shape[1]), num_blocks, dtype=torch.int64)
        pad_tables[:3] = tables.clamp(min=0)
        meta = PagedAttentionMetadata(slot_mapping=torch.cat([slots, torch.tensor([num_blocks * bs])]).to(device),
                                      query_start=[0, 1, 2, 3, 4], context_lens=lens + [1],
                                      block_tables=pad_tables.to(device), block_size=bs, num_decode=4,
                                      block_tables_host=pad_tables.numpy())
        routing = RoutingContext(record=True) if moe else None
        ctx = ForwardContext(attn=PagedAttention(caches, meta, paged_decode=True), routing=routing)
        hidden = model.hidden_states(torch.cat([ids, torch.tensor([0])])[None].to(device),
                                     torch.cat([pos, torch.tensor([0])])[None].to(device), ctx)[0]
        want = model.lm_head(hidden[:3])
        assert torch.allclose(logits.float(), want.float(), atol=tol, rtol=tol), (logits - want).abs().max()
        if routing is not None:
            assert torch.equal(routes, routing.stacked()[:3])
            assert routes.shape == (3, len(graphs.moe), a.num_experts_per_tok)
        written = torch.zeros(num_blocks + 1, bs, dtype=torch.bool)
        written.view(-1)[slots] = True
        for layer_g, layer_e, layer_0 in zip(graphed, caches, before):
            for cg, ce, c0 in zip(layer_g, layer_e, layer_0):
                cg, ce, c0 = cg.cpu(), ce.cpu(), c0.cpu()
                assert torch.allclose(cg[written].float(), ce[written].float(), atol=tol)  # the step's keys and values
                untouched = ~written
                untouched[num_blocks] = False  # the scratch block: the padding row's
                assert torch.equal(cg[untouched], c0[untouched])
        return logits

    first = check()
    model.load_state_dict(model_of(4).state_dict())  # copies into the parameters' storage
    assert not graphs.refresh()  # nothing moved: no capture again
    assert not torch.allclose(check().float(), first.float(), atol=tol, rtol=tol)  # the new weights computed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@torch.no_grad()
def test_engine_with_graphs_generates_what_it_does_eagerly(tmp_path):
    """Greedy completions of requests that join and finish at different steps (decode batches of
    every size from 1 to 10 between graph sizes, prefix-shared forks, a context past one span) with
    graphs and without (both with the fused kernels): the same tokens and logprobs within fp32, and
    the decode steps replayed.
    A parameter rebound to new storage (as a collective load's first does) is caught by refresh and
    the graphs are captured again."""
    from rlcli.infer.engine import NativeEngine
    from rlcli.protocol import GenerateRequest, SamplingParams

    model = load_model(write_tiny_model(tmp_path / "m"), seed=3).to("cuda").eval()

    def run(cuda_graphs: bool, engine: NativeEngine | None = None) -> tuple[list, NativeEngine]:
        engine = engine or NativeEngine(model, eos_token_ids=[], max_model_len=1400, block_size=16, max_num_seqs=12,
                                        cuda_graphs=cuda_graphs, enable_prefix_caching=False, fused_kernels=True)
        out = []
        for i, prompt_len in enumerate((5, 21, 9, 1100, 3)):
            engine.add_request(GenerateRequest(
                request_id=str(i), prompt_ids=[(7 * i + j) % 250 for j in range(prompt_len)],
                sampling=SamplingParams(temperature=0.0, max_tokens=12 + 9 * i, n=2, ignore_eos=True)))
            out += engine.step()
        while engine.has_work():
            out += engine.step()
        return sorted((r.request_id, c.token_ids, c.logprobs) for r in out for c in r.completions), engine

    graphed, engine = run(True)
    assert engine.graphs is not None and engine.stats()["num_graph_steps"] > 10
    assert engine.decode_mode.startswith(f"CUDA graphs at {len(engine.graphs.sizes)} batch sizes up to 12 (")
    eager, plain = run(False)
    assert plain.graphs is None and plain.stats()["num_graph_steps"] == 0
    for (rid, tokens, logprobs), (rid2, tokens2, logprobs2) in zip(graphed, eager):
        assert (rid, tokens) == (rid2, tokens2)
        assert max(abs(x - y) for x, y in zip(logprobs, logprobs2)) < 1e-4

    assert not engine.graphs.refresh()  # nothing moved
    w = model.model.layers[0].mlp.down_proj.weight
    old = w.data
    w.data = old.clone()
    old.zero_()  # graphs still reading the old storage would now compute another function
    assert engine.graphs.refresh()
    steps = engine.stats()["num_graph_steps"]
    again, _ = run(True, engine)
    assert engine.stats()["num_graph_steps"] > steps
    assert [(r, t) for r, t, _ in again] == [(r, t) for r, t, _ in graphed]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@torch.no_grad()
def test_fp8_engine_replays_its_decodes(tmp_path):
    """rl-infer --fp8 with the native engine on CUDA (FP8 weights and scales, bf16 activations) decodes
    through its graphs and generates what it does eagerly: greedy completions agree token for token
    until a near tie may part them (the GEMMs of a padded graph size and of the eager step's size may
    sum in another order), with the logprobs of their common part within bf16's error."""
    from rlcli.infer.engine import NativeEngine
    from rlcli.protocol import GenerateRequest, SamplingParams

    model = _fp8_model(write_tiny_model(tmp_path / "m"), "cuda", torch.bfloat16)

    def run(graphs: bool) -> tuple[list, NativeEngine]:
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=512, block_size=16, max_num_seqs=12,
                              cuda_graphs=graphs, fused_kernels=True)
        out = []
        for i, prompt_len in enumerate((5, 21, 9, 300)):
            engine.add_request(GenerateRequest(
                request_id=str(i), prompt_ids=[(7 * i + j) % 250 for j in range(prompt_len)],
                sampling=SamplingParams(temperature=0.0, max_tokens=24, n=2, ignore_eos=True)))
            out += engine.step()
        while engine.has_work():
            out += engine.step()
        return sorted((r.request_id, c.token_ids, c.logprobs) for r in out for c in r.completions), engine

    graphed, engine = run(True)
    assert engine.decode_mode.startswith("CUDA graphs") and engine.stats()["num_graph_steps"] > 10
    eager, _ = run(False)
    same = total = 0
    for (_, tokens, logprobs), (_, tokens2, logprobs2) in zip(graphed, eager):
        common = next((i for i, (a, b) in enumerate(zip(tokens, tokens2)) if a != b), len(tokens))
        same, total = same + common, total + len(tokens)
        assert max((abs(x - y) for x, y in zip(logprobs[:common], logprobs2[:common])), default=0) < 5e-2
    assert same >= 0.75 * total, (same, total)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("arch", ["moe", "mla", "dsa"])
@torch.no_grad()
def test_moe_engine_graphs_record_routes(arch, tmp_path):
    """A bf16 MoE engine on CUDA (Qwen3-MoE's GQA, DeepSeek-V3's MLA, V3.2's DSA) replays its decode steps and
    still returns every token's experts (R3): the routes of requests that ask for them cover every
    token, with two distinct experts each, and the prompt's (computed eagerly) are those of an engine
    without graphs."""
    from rlcli.infer.engine import NativeEngine
    from rlcli.protocol import GenerateRequest, SamplingParams

    model = load_model(write_tiny_model(tmp_path / "m", **ARCHS[arch]), seed=3).to("cuda", torch.bfloat16).eval()
    assert cuda_graphs.unsupported(model, paged_decode=True, batch_invariant=False, role="mixed") is None

    def run(graphs: bool) -> tuple[dict, NativeEngine]:
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=256, block_size=16, max_num_seqs=8,
                              cuda_graphs=graphs, fused_kernels=True)
        for i in range(3):
            engine.add_request(GenerateRequest(
                request_id=str(i), prompt_ids=[(7 * i + j) % 250 for j in range(9 + 4 * i)],
                sampling=SamplingParams(temperature=0.0, max_tokens=10, n=2, ignore_eos=True, return_routing=True)))
        out = {}
        while engine.has_work():
            out.update({r.request_id: r for r in engine.step() if hasattr(r, "completions")})
        return out, engine

    graphed, engine = run(True)
    assert engine.graphs is not None and engine.stats()["num_graph_steps"] > 5
    eager, _ = run(False)
    for rid, r in graphed.items():
        prompt_len = r.num_prompt_tokens
        for c, c_eager in zip(r.completions, eager[rid].completions):
            routes = c.routed_experts.numpy()
            assert routes.shape == (prompt_len + 10 - 1, len(engine.graphs.moe), 2)
            assert routes.min() >= 0 and routes.max() < 8 and (routes[:, :, 0] != routes[:, :, 1]).all()
            assert (routes[:prompt_len] == c_eager.routed_experts.numpy()[:prompt_len]).all()
