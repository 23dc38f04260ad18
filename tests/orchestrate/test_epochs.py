"""Dataset environments (num_tasks, task(index)) are drawn in epochs: every task once per epoch, in a
per-epoch shuffled order, resumed where the last written batch left off."""

import pytest
from procs import write_recipe

from rlcli.config import load_recipe
from rlcli.envs import EpochOrder
from rlcli.orchestrate.loop import Orchestrator
from rlcli.transport.rundir import RunDir
from test_restart import Announced
from test_staleness import finish

DATASET = '''
from rlcli.envs import Task


class Data:
    num_tasks = 5

    def task(self, index):
        return Task(prompt=f"t{index}=")

    def sample_task(self, rng):
        return self.task(rng.randrange(self.num_tasks))

    def reward(self, task, completion):
        return 0.0
'''


def test_each_epoch_is_a_permutation_and_a_saved_position_goes_on_the_same():
    order = EpochOrder(7, seed=3)
    drawn = [order.next() for _ in range(21)]
    epochs = [drawn[i:i + 7] for i in range(0, 21, 7)]
    assert all(sorted(e) == list(range(7)) for e in epochs) and len({tuple(e) for e in epochs}) == 3
    resumed = EpochOrder(7, seed=3, position=10)
    assert [resumed.next() for _ in range(11)] == drawn[10:] and resumed.epoch == 3.0
    other = EpochOrder(7, seed=4)
    assert [other.next() for _ in range(7)] != epochs[0]  # the recipe's seed picks the orders
    with pytest.raises(ValueError, match="num_tasks >= 1"):
        EpochOrder(0, seed=0)


class Held:
    """A pool that takes nothing: dispatched requests stay unsent, their groups in flight."""

    def __init__(self):
        self.ids = iter(range(10**6))

    def new_request_id(self):
        return f"r{next(self.ids)}"

    def submit(self, request, prefer=""):
        return False

    def serve_at_least(self, policy):
        pass

    def close(self):
        pass


def dispatched_prompts(o: Orchestrator) -> list[str]:
    return [o.tokenizer.decode(g.prompt_ids) for g in o.inflight.values()]


@pytest.mark.parametrize("order", ["epochs", "sample"])
def test_the_orchestrator_draws_a_dataset_in_epochs_and_resumes_its_position(tmp_path, tiny_model_dir, monkeypatch,
                                                                               order):
    (tmp_path / "dsenv.py").write_text(DATASET)
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, env={"name": "dsenv:Data",
                                                                                       "order": order},
                                   orchestrate={"batch_size": 3, "group_size": 2, "max_async": 1}))
    RunDir(run_dir).claim("t", {})
    o = Orchestrator(cfg, RunDir(run_dir))
    try:
        o.pool.close()
        o.pool = Held()
        o._set_policy(0)
        o.dispatch()  # batches 1 and 2: 6 groups
        prompts = dispatched_prompts(o)
        if order == "sample":
            assert o.order is None and len(prompts) == 6
            return
        expected = EpochOrder(5, cfg.seed)
        assert prompts == [f"t{expected.next()}=" for _ in range(6)]
        assert sorted(prompts[:5]) == [f"t{i}=" for i in range(5)]  # the first epoch: each task once
        for rid in list(o.inflight)[:3]:  # batch 1 comes back and is written
            group = o.inflight.pop(rid)
            finish(group, [0])
            o.buffer.append(group)
        o.pub.close()
        o.pub = Announced()
        assert o.try_write_batch()
        assert o.run.read_progress("orchestrate")["tasks_drawn"] == 6  # every task dispatched so far
    finally:
        o.close()
    again = Orchestrator(cfg, RunDir(run_dir))
    try:
        again.pool.close()
        again.pool = Held()
        again._set_policy(0)
        again.dispatch()
        rest = EpochOrder(5, cfg.seed, position=6)
        assert dispatched_prompts(again) == [f"t{rest.next()}=" for _ in range(len(again.inflight))]
        assert again.order.position == 6 + len(again.inflight)
    finally:
        again.close()
