"""Multi-turn episodes against two live rl-infer servers: token ids in and out, loss masks, per-turn
policy versions, prefix-cache reuse of every earlier turn (each turn goes back to the server that
answered the one before), and environments that fail without stopping the loop. The Orchestrator's own dispatch / reply / collect methods run in this process."""

import json
import logging
import time

import pytest
from procs import Procs, serve_initial_policy, wait_until, write_recipe

from rlcli.config import load_recipe
from rlcli.orchestrate.loop import Orchestrator
from rlcli.orchestrate.rollouts import write_batch
from rlcli.protocol.batch import decode_batch
from rlcli.transport.registry import list_entries
from rlcli.transport.rundir import RunDir

pytestmark = pytest.mark.timeout(240)

ENV_MODULE = '''
import time
from rlcli.envs import Task


class Chat:
    """Three model turns; the environment answers each of the first two with a short tool result."""

    def __init__(self, turns=3, fail=""):
        self.turns, self.fail = turns, fail

    def sample_task(self, rng):
        if self.fail == "sample-raises" and rng.random() < 0.5:
            raise ValueError("no task today")
        return Task(prompt="".join(rng.choice("abcd") for _ in range(rng.randint(3, 9))) + "=", max_tokens=6)

    def respond(self, task, messages):
        n = sum(m["role"] == "assistant" for m in messages)
        if self.fail == "respond-raises":
            raise RuntimeError("tool crashed")
        if self.fail == "respond-flaky":  # each turn fails once, then works
            seen = self.__dict__.setdefault("seen", set())
            turn = (task.prompt, repr(messages))
            if turn not in seen:
                seen.add(turn)
                raise ConnectionError("sandbox dropped")
        if self.fail == "respond-number":
            return 42
        return None if n >= self.turns else f"[tool {n}]"

    def reward(self, task, messages):
        if self.fail == "reward-slow":
            time.sleep(5)
        return float(len(messages))
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny import write_tiny_model

    tmp = tmp_path_factory.mktemp("episodes")
    model_dir = write_tiny_model(tmp / "tiny")
    (tmp / "mtenv.py").write_text(ENV_MODULE)
    run_dir = tmp / "run"
    recipe = write_recipe(tmp / "r.toml", model_dir, run_dir, model={"max_seq_len": 96},
                          env={"name": "mtenv:Chat", "max_turns": 8},
                          orchestrate={"batch_size": 2, "group_size": 2, "max_async": 0},
                          infer={"engine": {"name": "native", "num_threads": 1, "kv_cache_memory_mb": 16,
                                            "block_size": 4}})
    serve_initial_policy(run_dir, model_dir)
    procs = Procs(tmp / "logs")
    procs.start("infer-0", recipe, "--id", "0")
    procs.start("infer-1", recipe, "--id", "1")  # a later turn must find its earlier turns' KV all the same
    try:
        wait_until(lambda: len(list_entries(run_dir / "registry", "infer")) == 2, 120, "rl-infer registered", procs)
        yield tmp, recipe, run_dir
    finally:
        procs.stop_all()


def run_groups(recipe, run_dir, monkeypatch, tmp, overrides=None, num_groups=2, until=lambda o: True):
    monkeypatch.syspath_prepend(str(tmp))
    cfg = load_recipe(recipe, overrides={"env.args": {}, **(overrides or {})})
    o = Orchestrator(cfg, RunDir(run_dir))
    o._set_policy(0)
    deadline = time.monotonic() + 120
    try:
        while len(o.buffer) < num_groups or not until(o):
            assert time.monotonic() < deadline, "episodes did not finish"
            o.refresh()
            o.dispatch()
            for request, reply, server in o.pool.poll(20):
                o.on_reply(request, reply, server)
            o.collect()
    finally:
        o.close()
    return o


def test_turns_extend_one_sequence_and_reuse_all_earlier_kv(server, monkeypatch):
    tmp, recipe, run_dir = server
    o = run_groups(recipe, run_dir, monkeypatch, tmp)
    block_size = 4
    cached = reusable = 0
    for g in o.buffer:
        assert g.rewards == [5.0, 5.0]  # three model turns, two environment turns
        for ep, completion, mask in zip(g.episodes, g.completions, g.loss_masks):
            assert [t.role for t in ep.turns] == ["model", "env", "model", "env", "model"]
            assert completion.token_ids == ep.token_ids and mask == ep.loss_mask
            for k, turn in enumerate(ep.turns):
                ids = ep.token_ids[turn.start:turn.end]
                assert mask[turn.start:turn.end] == [turn.role == "model"] * len(ids)
                if turn.role == "env":  # appended as the environment wrote it, never re-tokenized
                    assert ids == o.tokenizer.encode(f"[tool {(k + 1) // 2}]", add_special_tokens=False)
                    assert ep.logprobs[turn.start:turn.end] == [0.0] * len(ids)
                    continue
                assert turn.num_prompt_tokens == len(g.prompt_ids) + turn.start  # the whole sequence so far
                if k:  # all KV of the previous request (its last sampled token was never fed) is reused
                    prev = ep.turns[k - 2]
                    expected = (len(g.prompt_ids) + prev.end - 1) // block_size * block_size
                    assert turn.num_cached_tokens == expected
                    cached, reusable = cached + turn.num_cached_tokens, reusable + expected
            assert ep.turn_versions() == [[0] * (t.end - t.start) for t in ep.turns if t.role == "model"]
    print(f"prefix-cache hit rate on later turns: {cached}/{reusable} = {cached / reusable:.3f}")
    assert reusable > 0 and cached == reusable

    # The batch the trainer reads: environment tokens are context (no loss, logprob or version).
    out = RunDir(tmp / "batch")  # not the server's run directory: a batch there would move the step on
    write_batch(out, 1, o.buffer, 1, 512, 1.0)
    batch = decode_batch((out.root / "rollouts" / "step_1" / "0.msgpack").read_bytes())
    trained = sum(int(mb.loss_mask.numpy().sum()) for mb in batch.micro_batches)
    model_tokens = sum(t.end - t.start for g in o.buffer for ep in g.episodes for t in ep.turns if t.role == "model")
    assert batch.num_loss_tokens == trained == model_tokens
    for mb in batch.micro_batches:
        mask, versions = mb.loss_mask.numpy(), mb.versions.numpy()
        assert (versions[mask] == 0).all() and (versions[~mask] == -1).all()
        assert (mb.inference_logprobs.numpy()[~mask] == 0).all()


@pytest.mark.parametrize("fail, error", [("respond-raises", "RuntimeError: tool crashed"),
                                         ("respond-number", "respond returned int"),
                                         ("reward-slow", "no result within env.reward_timeout_s"),
                                         ("sample-raises", "sample_task failed (ValueError: no task today)")])
def test_a_failing_environment_is_scored_on_error_and_named(server, monkeypatch, caplog, fail, error):
    tmp, recipe, run_dir = server
    with caplog.at_level(logging.WARNING, logger="rlcli.envs"):
        o = run_groups(recipe, run_dir, monkeypatch, tmp, {"env.args": {"fail": fail}, "env.on_error": -1.0,
                                                          "env.reward_timeout_s": 0.5})
    assert any("env mtenv:Chat: " in r.getMessage() and error in r.getMessage() for r in caplog.records)
    assert o.episodes.metrics()["env_errors"] >= (1 if fail == "sample-raises" else 4)
    if fail != "sample-raises":
        assert all(g.rewards == [-1.0, -1.0] for g in o.buffer)
        assert all(ep.error and error in ep.error for g in o.buffer for ep in g.episodes)
    else:  # the tasks that could be sampled ran normally
        assert all(g.rewards == [5.0, 5.0] for g in o.buffer)


def test_with_env_errors_mask_a_failed_episode_trains_nothing(server, monkeypatch):
    """env.errors = "mask": an episode whose environment raised keeps its on_error score for the record,
    but no loss token and advantage 0, and the group marks it errored."""
    tmp, recipe, run_dir = server
    o = run_groups(recipe, run_dir, monkeypatch, tmp, {"env.args": {"fail": "respond-raises"}, "env.on_error": -1.0,
                                                      "env.errors": "mask"})
    for g in o.buffer:
        assert g.errored == [True, True] and g.rewards == [-1.0, -1.0] and g.advantages == [0.0, 0.0]
        assert all(not any(m) for m in g.loss_masks) and all(s.num_loss_tokens == 0 for s in g.samples())


def test_an_evaluation_round_runs_multi_turn_episodes_under_its_own_sampling(server, monkeypatch):
    """orchestrate.eval beside training: the round's episodes take every environment turn (reward 5, as
    training's), with eval.samples completions per task, and none of its groups joins the buffer."""
    from rlcli.orchestrate.evaluation import Evaluation

    tmp, recipe, run_dir = server
    (run_dir / "metrics" / "eval.jsonl").unlink(missing_ok=True)  # the module's run directory: a round of its own
    started, start = [], Evaluation.start
    monkeypatch.setattr(Evaluation, "start", lambda self, v: started.extend(start(self, v)) or started)
    o = run_groups(recipe, run_dir, monkeypatch, tmp, {"orchestrate.eval.interval": 1, "orchestrate.eval.num_tasks": 3,
                                                      "orchestrate.eval.samples": 3},
                   until=lambda o: 0 in o.evaluation.done)
    assert all(g.eval_version is None and len(g.completions) == 2 for g in o.buffer)
    [m] = [m for m in RunDir(run_dir).read_metrics("eval") if m["step"] == 0]
    assert m["num_tasks"] == 3 and m["reward_mean"] == 5.0
    records = [json.loads(line) for line in (run_dir / "evals" / "policy_0.jsonl").read_text().splitlines()]
    assert [r["rewards"] for r in records] == [[5.0] * 3] * 3
    turns = [t for g in started for ep in g.episodes for t in ep.turns if t.role == "model"]
    assert len(started) == 3 and len(turns) == 3 * 3 * 3  # tasks x eval.samples x model turns


def test_an_evaluation_environment_of_its_own_runs_beside_training(server, monkeypatch):
    """orchestrate.eval.env: the round's tasks come from another environment (single-turn reverse, while
    training runs the multi-turn Chat) and are scored by it, on episodes of their own."""
    from rlcli.envs.reverse import similarity

    tmp, recipe, run_dir = server
    (run_dir / "metrics" / "eval.jsonl").unlink(missing_ok=True)  # the module's run directory: a round of its own
    o = run_groups(recipe, run_dir, monkeypatch, tmp, {"orchestrate.eval.interval": 1, "orchestrate.eval.num_tasks": 2,
                                                      "orchestrate.eval.samples": 2, "orchestrate.eval.seed": 99,
                                                      "orchestrate.eval.env": "reverse",
                                                      "orchestrate.eval.env_args": {"min_len": 3, "max_len": 4}},
                   until=lambda o: 0 in o.evaluation.done)
    assert all(g.rewards == [5.0, 5.0] for g in o.buffer)  # training: Chat's three-turn episodes
    records = [json.loads(line) for line in (run_dir / "evals" / "policy_0.jsonl").read_text().splitlines()]
    assert len(records) == 2
    assert all(r["prompt"].endswith("=") and 3 <= len(r["answer"]) <= 4 for r in records)
    for r in records:
        assert r["rewards"] == pytest.approx([similarity(c.strip().strip("'\"").strip(), r["answer"])
                                              for c in r["completions"]])


def test_a_bad_evaluation_environment_is_refused_before_the_run_is_claimed(server, monkeypatch):
    from rlcli.errors import ConfigError
    from rlcli.orchestrate.entrypoints import prepare

    tmp, recipe, _ = server
    monkeypatch.syspath_prepend(str(tmp))
    cfg = load_recipe(recipe, overrides={"env.args": {}, "orchestrate.eval.interval": 1,
                                         "orchestrate.eval.env": "chess"})
    with pytest.raises(ConfigError, match="orchestrate.eval.env: unknown env.name 'chess'"):
        prepare(cfg)


def test_env_retries_carry_an_episode_past_a_flaky_environment(server, monkeypatch):
    tmp, recipe, run_dir = server
    o = run_groups(recipe, run_dir, monkeypatch, tmp, {"env.args": {"fail": "respond-flaky"}, "env.on_error": -1.0,
                                                      "env.retries": 1})
    assert all(g.rewards == [5.0, 5.0] and not g.errored for g in o.buffer)
    m = o.episodes.metrics()
    assert m["env_errors"] == 0 and m["env_retries"] >= 2 * 2 * 2  # groups x completions x environment turns


def test_a_mixture_runs_each_task_as_its_own_environment_would(server, monkeypatch):
    """env.name = "mix" of the multi-turn Chat and the single-turn reverse: Chat's episodes take their
    environment turns, reverse's end after one model turn and are scored on its text, and the step's
    metrics name each environment's mean reward."""
    from rlcli.envs.mix import per_env
    from rlcli.envs.reverse import similarity

    tmp, recipe, run_dir = server
    o = run_groups(recipe, run_dir, monkeypatch, tmp, {"env.name": "mix", "env.args": {"envs": [
        {"name": "mtenv:Chat"}, {"name": "reverse", "args": {"min_len": 3, "max_len": 5}}]},
        "orchestrate.batch_size": 6}, num_groups=6,
        until=lambda o: len({g.task.info["env"] for g in o.buffer}) == 2)
    for g in o.buffer:
        turns = [[t.role for t in ep.turns] for ep in g.episodes]
        if g.task.info["env"] == "reverse":
            assert turns == [["model"]] * 2
            texts = [o.tokenizer.decode(c.token_ids).strip() for c in g.completions]
            assert g.rewards == pytest.approx([similarity(t.strip("'\"").strip(), g.task.answer) for t in texts])
        else:
            assert turns == [["model", "env", "model", "env", "model"]] * 2 and g.rewards == [5.0, 5.0]
    means = per_env((g.task, g.rewards) for g in o.buffer)
    assert set(means) == {"reward_mean/mtenv:Chat", "reward_mean/reverse"} and means["reward_mean/mtenv:Chat"] == 5.0


def test_token_budget_truncates_episodes(server, monkeypatch):
    tmp, recipe, run_dir = server
    o = run_groups(recipe, run_dir, monkeypatch, tmp, {"env.max_episode_tokens": 24, "env.truncation": "mask"})
    for g in o.buffer:
        for ep, completion in zip(g.episodes, g.completions):
            assert len(g.prompt_ids) + len(completion.token_ids) <= 24
            if ep.truncated:
                assert not any(ep.loss_mask)
    assert any(ep.truncated for g in o.buffer for ep in g.episodes)


@pytest.mark.parametrize("truncation", ["on_error", "reward"])
def test_a_cut_episode_is_worth_what_env_truncation_says(server, monkeypatch, truncation):
    """Past env.max_episode_tokens: "on_error" scores the cut episode env.on_error, "reward" has the
    environment score it and trains it (its model tokens keep their loss)."""
    tmp, recipe, run_dir = server
    o = run_groups(recipe, run_dir, monkeypatch, tmp, {"env.max_episode_tokens": 24, "env.truncation": truncation,
                                                      "env.on_error": -1.0})
    cut = [(ep, reward) for g in o.buffer for ep, reward in zip(g.episodes, g.rewards) if ep.truncated]
    assert cut
    for ep, reward in cut:
        model_turns = [t for t in ep.turns if t.role == "model"]
        if truncation == "on_error":
            assert reward == -1.0
        else:
            assert reward == float(len(ep.messages)) and reward > 0  # mtenv.Chat's reward: its message count
            assert sum(ep.loss_mask) == sum(t.end - t.start for t in model_turns) > 0


def test_max_turns_ends_the_episode_and_scores_it(server, monkeypatch):
    """env.max_turns = 2 under an environment that would go on for three model turns: the episode
    ends after its second model turn and is scored by the environment's reward."""
    tmp, recipe, run_dir = server
    o = run_groups(recipe, run_dir, monkeypatch, tmp, {"env.max_turns": 2})
    for g in o.buffer:
        assert g.rewards == [3.0, 3.0]  # two model turns and the environment's one answer
        assert all([t.role for t in ep.turns] == ["model", "env", "model"] and not ep.truncated for ep in g.episodes)


def test_an_episode_past_its_time_budget_is_scored_on_error(server, monkeypatch, caplog):
    tmp, recipe, run_dir = server
    with caplog.at_level(logging.WARNING, logger="rlcli.envs"):
        o = run_groups(recipe, run_dir, monkeypatch, tmp, {"env.episode_timeout_s": 1e-3, "env.on_error": -1.0})
    assert all(g.rewards == [-1.0, -1.0] for g in o.buffer)
    assert all(ep.error == "episode ran past its time budget of 0.001s" for g in o.buffer for ep in g.episodes)
    assert any("time budget" in r.getMessage() for r in caplog.records)


def test_episodes_run_the_same_in_worker_processes(server, monkeypatch):
    """env.executor = "processes": every respond and reward runs in a worker process with its own copy of
    the environment (mtenv.Chat, built there from the env table); the episodes are the same."""
    tmp, recipe, run_dir = server
    o = run_groups(recipe, run_dir, monkeypatch, tmp, overrides={"env.executor": "processes", "env.num_workers": 2})
    for g in o.buffer:
        assert g.rewards == [5.0, 5.0]
        assert all([t.role for t in ep.turns] == ["model", "env", "model", "env", "model"] for ep in g.episodes)
