"""verifiers environments run by verifiers itself (its Env, agent, harness program and
training client) against a real rl-infer process's HTTP API; the samples carry the
server's exact tokens, logprobs and versions, and their rewards equal verifiers' own
scoring of the same traces."""

import asyncio
import json
import random
import urllib.request

import pytest

from chat_tokenizer import write_chat_tokenizer
from procs import Procs, wait_until, write_recipe
from vf_modules import write_vf_modules
from tiny import write_tiny_model
from rlcli.models import load_model, save_model
from rlcli.transport.atomic import atomic_dir
from rlcli.transport.registry import list_entries

pytest.importorskip("verifiers.v1", reason="verifiers is the `verifiers` extra")
pytestmark = pytest.mark.timeout(300)

MAX_LEN = 512
BLOCK = 16  # the native engine's KV block (infer.engine.block_size)

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vfhttp")
    src = write_tiny_model(root / "tiny", max_position_embeddings=MAX_LEN)
    (src / "tokenizer_config.json").unlink()
    write_chat_tokenizer(src)
    run_dir = root / "run"
    with atomic_dir(run_dir / "weights" / "step_0") as tmp:
        save_model(load_model(src, seed=1), tmp, source_dir=src)
    recipe = write_recipe(root / "r.toml", src, run_dir, model={"path": str(src), "max_seq_len": MAX_LEN},
                          infer={"http_port": 0}, train={"micro_batch_tokens": MAX_LEN})
    write_vf_modules(root)
    procs = Procs(root / "logs")
    procs.start("infer-0", recipe, "--id", "0")
    try:
        entry = wait_until(lambda: next(iter(list_entries(run_dir / "registry", "infer")), None), 120,
                           "rl-infer registered", procs)
        yield {"http": entry.endpoints["http"], "model_dir": src, "root": root}
    finally:
        procs.stop_all()


@pytest.fixture
def taskset(server, monkeypatch):
    monkeypatch.syspath_prepend(str(server["root"]))
    return "vf_echo"


def make(taskset, **args):
    from rlcli.envs.verifiers_adapter import VerifiersEnv

    return VerifiersEnv(taskset=taskset, **args)


def run_group(env, server, n, salt="v0"):
    task = env.sample_task(random.Random(0))
    future = env.run_group(task, n, server["http"], server["model_dir"].name, str(server["model_dir"]),
                           {"temperature": 1.0, "max_tokens": 8}, salt, version_floor=0)
    return task, future.result(timeout=200)


def test_token_generate_endpoint_returns_exact_tokens_logprobs_versions(server):
    body = {"model": server["model_dir"].name, "token_ids": [257, 84, 82, 68, 81, 198], "cache_salt": "s",
            "sampling_params": {"max_tokens": 5, "temperature": 1.0, "logprobs": 1, "seed": 3, "ignore_eos": True}}
    req = urllib.request.Request(server["http"] + "/inference/v1/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    choice = out["choices"][0]
    assert out["prompt_token_ids"] == body["token_ids"] and len(choice["token_ids"]) == 5
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["logprob"] <= 0 for e in choice["logprobs"]["content"])
    assert choice["policy_versions"] == [0] * 5 and choice["finish_reason"] == "length"
    bad = {**body, "sampling_params": {"max_tokens": 5, "top_k": 5}}
    req = urllib.request.Request(server["http"] + "/inference/v1/generate", data=json.dumps(bad).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and "top_k" in json.loads(e.value.read())["error"]["message"]


def check_samples(samples, tokenizer_dir, num_turns):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for s in samples:
        n = len(s.token_ids)
        assert len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n
        first = s.loss_mask.index(True)
        prompt = tok.decode(s.token_ids[:first])
        assert prompt.startswith("<|im_start|>system\nBe brief.") and prompt.endswith("<|im_start|>assistant\n")
        assert s.num_turns == num_turns and len(s.turn_prompt_tokens) == num_turns
        # Sampled spans are the model's; every other token is context (template and the env's turns).
        spans, start = [], None
        for i, m in enumerate(s.loss_mask + [False]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append((start, i))
                start = None
        assert len(spans) == num_turns
        for a, b in spans:
            assert all(lp <= 0 for lp in s.logprobs[a:b]) and all(v == 0 for v in s.versions[a:b])
            assert tok.decode(s.token_ids[:a]).endswith("<|im_start|>assistant\n")
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if not m)
        for (a, b), (c, _) in zip(spans, spans[1:]):
            between = tok.decode(s.token_ids[b:c])
            assert "<|im_start|>user\ntry again" in between  # the environment's turn: context
        # Each turn's prompt is the sequence before it, and the server reused the earlier turns' KV.
        assert s.turn_prompt_tokens == [a for a, _ in spans]
        assert s.token_ids.count(im_start) >= 2 + 2 * num_turns - 1 and im_end in s.token_ids


def rescored(env, task, samples, tokenizer_dir):
    """verifiers' own scoring of the same completions: a fresh trace of the sampled text, scored by the task."""
    import transformers
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, SystemMessage, UserMessage

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vtask = env.tasks[task.info["index"]]
    out = []
    for s in samples:
        nodes = [MessageNode(message=SystemMessage(content=vtask.data.system_prompt)),
                 MessageNode(parent=0, message=UserMessage(content=vtask.data.prompt))]
        spans = [i for i, m in enumerate(s.loss_mask) if m and (i == 0 or not s.loss_mask[i - 1])]
        for k, a in enumerate(spans):
            b = a
            while b < len(s.loss_mask) and s.loss_mask[b]:
                b += 1
            ids = s.token_ids[a:b]
            text = tok.decode([t for t in ids if t != tok.eos_token_id])
            if k:
                nodes.append(MessageNode(parent=len(nodes) - 1, message=UserMessage(content=f"try again ({k})")))
            nodes.append(MessageNode(parent=len(nodes) - 1, message=AssistantMessage(content=text), sampled=True))
        trace = Trace(task=TraceTask(type="EchoTask", data=vtask.data), agent=AgentInfo(config=vf.AgentConfig()),
                      nodes=nodes)
        asyncio.run(vtask.score(trace))
        out.append(trace.reward)
    return out


def test_single_turn_taskset_runs_through_the_http_api(server, taskset):
    env = make(taskset)
    try:
        task, episodes = run_group(env, server, n=3)
    finally:
        env.close()
    assert len(episodes) == 3 and all(len(e) == 1 for e in episodes)
    samples = [e[0] for e in episodes]
    assert all(s.error is None for s in samples)
    check_samples(samples, server["model_dir"], num_turns=1)
    assert [s.reward for s in samples] == pytest.approx(rescored(env, task, samples, server["model_dir"]))
    assert all(s.reward >= 0.25 for s in samples)  # the turns reward saw one model turn


def test_multi_turn_env_runs_through_the_http_api_reusing_kv(server, taskset):
    # The template's own renderer bridges turns, so the whole episode stays one sequence.
    env = make(taskset, env_id="vf-feedback", renderer={"name": "custom", "import_path": "chat_tokenizer.ChatMLRenderer"})
    try:
        task, episodes = run_group(env, server, n=2, salt="v0-multi")
    finally:
        env.close()
    samples = [e[0] for e in episodes]
    assert all(s.error is None for s in samples), samples[0].error
    check_samples(samples, server["model_dir"], num_turns=3)
    assert [s.reward for s in samples] == pytest.approx(rescored(env, task, samples, server["model_dir"]))
    for s in samples:
        # Every turn after the first found the earlier turns' KV in the prefix cache (up to a partial block).
        for k in range(1, len(s.turn_prompt_tokens)):
            earlier = s.turn_prompt_tokens[k - 1] + s.turn_completion_tokens[k - 1] - 1
            assert earlier - BLOCK < s.turn_cached_tokens[k] <= earlier


def test_recipe_runs_rl_steps_with_a_verifiers_env_over_http(server, tmp_path):
    import subprocess
    import sys

    from procs import read_jsonl
    from rlcli.protocol.batch import decode_batch

    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", server["model_dir"], run_dir,
                          model={"path": str(server["model_dir"]), "max_seq_len": 96},
                          env={"name": "verifiers", "args": {"taskset": "vf_echo"}},
                          infer={"http_port": 0}, top={"num_steps": 2},
                          orchestrate={"batch_size": 2, "group_size": 2, "sampling": {"max_tokens": 6}})
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "up", str(recipe), "--no-plot"],
                         cwd=server["root"], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(run_dir / "metrics" / "train.jsonl")] == [1, 2]
    metrics = read_jsonl(run_dir / "metrics" / "orchestrate.jsonl")
    assert all(m["http_env_errors"] == 0 and m["num_samples"] == 4 for m in metrics)
    # the names docs/envs.md gives; a single-turn taskset has no turn after an episode's first
    assert all(m["http_turns"] == 0 and m["http_turn_cached_fraction"] == m["http_turn_kv_reuse"] == 0.0
               for m in metrics)
    batch = decode_batch((run_dir / "rollouts" / "step_1" / "0.msgpack").read_bytes())
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(server["model_dir"]))
    mb = batch.micro_batches[0]
    ids, loss = mb.input_ids.numpy().tolist(), mb.loss_mask.numpy().tolist()
    assert "<|im_start|>system\nBe brief." in tok.decode(ids) and any(loss)
    assert {v for v, m in zip(mb.versions.numpy().tolist(), loss) if m} == {0}  # step 1 trains policy 0's tokens


def test_r3_is_refused_for_episodes_run_over_http(tmp_path):
    """HTTP returns no expert routes: an env that runs its groups over HTTP with r3 = true is a config
    error that names both ways out."""
    from rlcli.config import load_recipe
    from rlcli.errors import ConfigError
    from rlcli.orchestrate.http_groups import HttpGroups

    model_dir = write_tiny_model(tmp_path / "tiny")
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", model_dir, tmp_path / "run", top={"r3": True},
                                   env={"name": "verifiers", "args": {"taskset": "vf_echo"}}, infer={"http_port": 0}))
    with pytest.raises(ConfigError, match="set r3 = false, or infer.http_port = -1"):
        HttpGroups(cfg, None, None)


@pytest.mark.parametrize("errors", ["reward", "mask"])
def test_a_failed_verifiers_episode_is_scored_on_error_and_masked_with_env_errors_mask(errors):
    """A trace verifiers failed is scored env.on_error; with env.errors = "mask" its model tokens leave the
    loss and the group marks it errored (the loop then leaves it out of the baseline)."""
    from rlcli.config import RecipeConfig
    from rlcli.config.env import EnvConfig
    from rlcli.envs import Task
    from rlcli.envs.verifiers_http import Sample
    from rlcli.orchestrate.http_groups import HttpGroups
    from rlcli.orchestrate.rollouts import Group

    groups = HttpGroups.__new__(HttpGroups)
    groups.cfg = RecipeConfig(env=EnvConfig(name="x:y", on_error=-1.0, errors=errors))
    groups.reset_stats()
    ok = Sample(token_ids=[1, 2, 3, 4], loss_mask=[False, False, True, True], logprobs=[0, 0, -1, -1],
                     versions=[0] * 4, reward=1.0)
    bad = Sample(token_ids=[1, 2, 5, 6], loss_mask=[False, False, True, True], logprobs=[0, 0, -1, -1],
                      versions=[0] * 4, reward=1.0, error="the sandbox timed out")
    group = Group(Task("t"), [], 0)
    assert groups._fill(group, [ok, bad])
    assert group.rewards == [1.0, -1.0] and group.errored == [False, True] and groups.num_errors == 1
    assert group.loss_masks[0] == [True, True]
    assert group.loss_masks[1] == ([False, False] if errors == "mask" else [True, True])
