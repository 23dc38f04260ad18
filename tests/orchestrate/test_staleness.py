"""Deadline-ordered batch assembly: no group is dropped for staleness, no batch exceeds the
bound, and a saturated task set cannot stall the loop. The Orchestrator's own methods run
against a simulated inference pool (random completion times, weights updated per batch)."""

import random

import pytest
from tiny import TINY_MODEL

from rlcli.config import RecipeConfig
from rlcli.config.orchestrate import AdvantageConfig, OrchestrateConfig
from rlcli.envs import Task
from rlcli.models.tokenizer import load_tokenizer
from rlcli.orchestrate.loop import Orchestrator
from rlcli.orchestrate.rollouts import Group
from rlcli.protocol import Completion


def bare_orchestrator(max_async: int, batch_size: int, num_steps: int, max_off_policy_steps: int | None = None,
                      **advantage) -> Orchestrator:
    cfg = RecipeConfig(num_steps=num_steps, orchestrate=OrchestrateConfig(
        batch_size=batch_size, group_size=2, max_async=max_async, max_off_policy_steps=max_off_policy_steps,
        advantage=AdvantageConfig(**advantage)))
    return Orchestrator.schedule_only(cfg, load_tokenizer(TINY_MODEL))


def finish(group: Group, versions: list[int], rewards=(0.0, 1.0)) -> None:
    group.completions = [Completion(token_ids=[1] * len(versions), logprobs=[0.0] * len(versions),
                                    versions=list(versions), finish_reason="length") for _ in rewards]
    group.rewards, group.advantages = list(rewards), [r - sum(rewards) / len(rewards) for r in rewards]


def simulate(max_async: int, seed: int, batch_size: int = 4, num_steps: int = 30,
             max_off_policy_steps: int | None = None, ticks: list | None = None):
    """Event loop: each tick every in-flight group may finish (long-tailed: some take many
    ticks), its tokens tagged with versions from dispatch up to the current policy; a written
    batch becomes the next policy one tick later. Returns the (step, lag) of every trained group
    (and appends the number of ticks the run took to ``ticks``)."""
    rng = random.Random(seed)
    o = bare_orchestrator(max_async, batch_size, num_steps, max_off_policy_steps)
    remaining: dict[int, int] = {}
    trained, next_rid = [], 0
    pending_policy: list[int] = []
    tick = 0
    while o.next_step <= num_steps:
        tick += 1
        if pending_policy:
            o.policy_version = pending_policy.pop(0)
        for _ in range(o.num_to_dispatch()):
            g = Group(Task("t"), [0], o.policy_version)
            o.inflight[str(next_rid)] = g
            remaining[next_rid] = min(int(rng.lognormvariate(0.5, 1.2)) + 1, 60)
            next_rid += 1
        for rid in list(o.inflight):
            remaining[int(rid)] -= 1
            if remaining[int(rid)] <= 0:
                g = o.inflight.pop(rid)
                finish(g, [g.dispatch_version] + [o.policy_version] * 3)
                o.buffer.append(g)
        groups = o.select_batch()
        if groups is not None:
            taken = {id(g) for g in groups}
            o.buffer = [g for g in o.buffer if id(g) not in taken]
            trained += [(o.next_step, o.next_step - 1 - g.min_version) for g in groups]
            assert len(groups) == batch_size
            pending_policy.append(o.next_step)
            o.next_step += 1
        assert o.num_stale == 0
    if ticks is not None:
        ticks.append(tick)
    return trained


def test_no_group_is_dropped_and_the_bound_holds():
    for max_async in (0, 1, 2, 4):
        for seed in range(3):
            trained = simulate(max_async, seed)
            assert max(lag for _, lag in trained) <= max_async
            if max_async:
                assert max(lag for _, lag in trained) > 0  # it really ran off-policy


def test_a_looser_bound_trains_stragglers_late_instead_of_waiting_for_them():
    """max_off_policy_steps above max_async: the orchestrator still runs max_async ahead, but a
    straggler may join a batch up to the bound's steps late, so fewer batches wait for one."""
    strict, loose = [], []
    for seed in range(4):
        trained = simulate(2, seed, num_steps=60, ticks=strict)
        assert max(lag for _, lag in trained) <= 2
        trained = simulate(2, seed, num_steps=60, max_off_policy_steps=5, ticks=loose)
        lags = [lag for _, lag in trained]
        assert max(lags) <= 5 and max(lags) > 2  # stragglers were trained late, not dropped (num_stale == 0)
    assert sum(loose) < sum(strict)


def test_max_async_zero_is_synchronous_whatever_the_bound():
    for seed in range(3):
        assert {lag for _, lag in simulate(0, seed, max_off_policy_steps=3)} == {0}


def test_batch_waits_for_a_straggler_due_now_and_takes_it_first():
    o = bare_orchestrator(max_async=1, batch_size=2, num_steps=10)
    old = Group(Task("old"), [0], 0)  # deadline: batch 0 + 1 + 1 = 2
    o.inflight["old"] = old
    for v in (1, 1):
        g = Group(Task("new"), [0], v)
        finish(g, [v])
        o.buffer.append(g)
    o.next_step = 2
    assert o.select_batch() is None  # batch 2 must hold the old group: wait for it
    finish(o.inflight.pop("old"), [0, 1, 1])
    o.buffer.append(old)
    batch = o.select_batch()
    assert batch is not None and old in batch


def test_deadline_uses_the_oldest_token_not_the_dispatch_version():
    o = bare_orchestrator(max_async=1, batch_size=1, num_steps=10)
    g = Group(Task("t"), [0], 0)
    assert o.deadline(g) == 2  # in flight: the dispatch version is a lower bound
    finish(g, [3, 3])  # the server had newer weights by the time it sampled
    assert o.deadline(g) == 5


def test_zero_variance_drops_are_capped_then_groups_join_anyway():
    o = bare_orchestrator(max_async=0, batch_size=2, num_steps=5, skip_zero_variance=True,
                          max_zero_variance_drops=3)
    from rlcli.protocol import GenerateRequest, GenerateResponse

    for i in range(5):
        g = Group(o.env.sample_task(random.Random(i)), [0], 0)
        o.inflight[str(i)] = g
        c = Completion(token_ids=[5], logprobs=[0.0], versions=[0], finish_reason="length")
        o.on_reply(GenerateRequest(request_id=str(i), prompt_ids=[0]),
                   GenerateResponse(request_id=str(i), completions=[c, c], num_prompt_tokens=1))
    o.episodes.runner.wait(30)  # rewards run on worker threads
    o.collect()
    assert o.num_filtered == 3 and o.num_zero_variance_kept == 2 and len(o.buffer) == 2


def test_each_step_reports_the_trained_length_distribution():
    """Mean and max hide a long tail: the step's record carries percentiles of the trained lengths."""
    from rlcli.orchestrate.loop import percentile

    o = bare_orchestrator(1, 2, 30)
    o.http = None
    o._reset_step_stats()
    groups = []
    for lengths in ([1] * 9, [100]):
        g = Group(Task("t"), [0], 0)
        g.completions = [Completion(token_ids=[1] * n, logprobs=[0.0] * n, versions=[0] * n, finish_reason="length")
                         for n in lengths]
        g.rewards = [0.0] * len(lengths)
        groups.append(g)
    m = o._metrics(1, groups, {})
    assert (m["completion_len_p50"], m["completion_len_p90"], m["completion_len_p99"]) == (1, 1, 100)
    assert m["completion_len_max"] == 100 and percentile([3, 1, 2], 50) == 2


def test_failed_episodes_train_nothing_and_leave_the_baseline_with_env_errors_mask():
    """env.errors = "mask": a completion whose environment failed (scored env.on_error) gets advantage 0
    and the others are centred on their own mean; "reward" (the default) trains the on_error score. A group
    that failed whole counts as zero-variance."""
    from rlcli.config.env import EnvConfig

    def scored(errors: str, rewards, errored, **advantage):
        cfg = RecipeConfig(env=EnvConfig(errors=errors), orchestrate=OrchestrateConfig(
            batch_size=2, group_size=len(rewards), advantage=AdvantageConfig(**advantage)))
        o = Orchestrator.schedule_only(cfg, load_tokenizer(TINY_MODEL))
        g = Group(Task("t"), [0], 0)
        g.rewards, g.errored = list(rewards), list(errored)
        o.on_scored(g)
        return o, g

    _, g = scored("mask", [-1.0, 1.0, 0.0], [True, False, False])
    assert g.advantages == [0.0, 0.5, -0.5]
    _, g = scored("reward", [-1.0, 1.0, 0.0], [True, False, False])
    assert g.advantages == [-1.0, 1.0, 0.0]
    _, g = scored("mask", [-1.0, -1.0], [True, True])
    assert g.advantages == [0.0, 0.0]
    o, g = scored("mask", [-1.0, 3.0], [True, True], skip_zero_variance=True)
    assert o.num_filtered == 1 and not o.buffer
    o, g = scored("reward", [-1.0, 3.0], [True, False], skip_zero_variance=True)
    assert o.num_filtered == 0 and g.advantages == [-2.0, 2.0]
    o, g = scored("mask", [-1.0, 3.0], [True, False], skip_zero_variance=True)  # one survivor: no variance
    assert o.num_filtered == 1


def test_overlong_buffer_takes_reward_from_completions_near_their_budget():
    """DAPO's soft overlong punishment: with max_tokens 32 and a buffer of 8, lengths 24, 28 and 32 lose
    0, half and all of overlong_penalty before the advantages; the logged rewards stay the environment's."""
    from rlcli.orchestrate.advantages import overlong_penalty

    assert [overlong_penalty(n, 32, 8) for n in (10, 24, 28, 32)] == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(32, 32, 0) == 0.0 and overlong_penalty(30, 32, 8, scale=0.5) == -0.375
    o = bare_orchestrator(1, 2, 30, overlong_buffer=8, overlong_penalty=2.0)
    g = Group(Task("t"), [0, 1, 2], 0)  # sampling.max_tokens 32 (the default)
    g.completions = [Completion(token_ids=[1] * n, logprobs=[0.0] * n, versions=[0] * n, finish_reason="stop")
                     for n in (24, 28, 32)]
    g.rewards = [1.0, 1.0, 1.0]
    o.on_scored(g)
    assert g.rewards == [1.0, 1.0, 1.0] and g.advantages == pytest.approx([1.0, 0.0, -1.0])
    assert o.overlong_penalties == [0.0, -1.0, -2.0]


def test_overlong_buffer_is_refused_for_a_multi_turn_environment(tmp_path, tiny_model_dir):
    from procs import write_recipe
    from rlcli.config import load_recipe
    from rlcli.errors import ConfigError
    from rlcli.orchestrate.entrypoints import prepare

    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run", env={"name": "tool-use"},
                                   orchestrate={"advantage": {"overlong_buffer": 4}}))
    with pytest.raises(ConfigError, match="overlong_buffer is for single-turn environments and tool-use is multi-turn"):
        prepare(cfg)
