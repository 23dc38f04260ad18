"""The most asynchronous RL can gain over synchronous RL on a workload, by rl-orchestrate's own rules.

A discrete-event model of the loop: completion lengths are drawn from the recipe's environment
(``task.max_tokens``, as the long-tail recipe sets them; otherwise ``sampling.max_tokens``), a group
takes ``--token-ms`` per token however many others run (free concurrency: a GPU engine's decode
step at small batch, and the ceiling's premise), a batch takes ``--train-ms`` to train, and a
policy is served ``--publish-ms`` after its step ends. What to dispatch and when a batch may be
written are decided by the real :class:`~rlcli.orchestrate.loop.Orchestrator` methods
(``num_to_dispatch``, ``select_batch``), once with max_async = 0 (the baseline) and once per
(max_async, max_off_policy_steps) pair. It prints the mean step time of each and its ratio to
synchronous RL, the mean and largest off-policy lag, and nothing measured: it is the bound
``bench/async_vs_sync.py`` measures against.

With the staleness bound at max_async, every group of the cohort dispatched under policy v must
be in batch v + 1 + max_async, so a batch waits for that cohort's longest completion; after a long
wait the cohorts in flight finish together and the pipeline refills one trainer step at a time.
A larger bound lets such a completion be trained later instead.

    python bench/async_ceiling.py [--recipe recipes/bench-longtail.toml] [--max-async 2]
                                  [--bounds 2 3 4 6 8] [--token-ms 2.6] [--train-ms 100] [--publish-ms 20]
"""

import argparse
import heapq
import random
import statistics
from pathlib import Path

from rlcli.config import load_recipe
from rlcli.envs import make_env
from rlcli.models.tokenizer import load_tokenizer
from rlcli.orchestrate.episodes import Episodes
from rlcli.orchestrate.loop import Orchestrator
from rlcli.orchestrate.rollouts import Group
from rlcli.protocol import Completion

REPO = Path(__file__).resolve().parent.parent


def orchestrator(recipe: Path, max_async: int, bound: int | None, steps: int) -> Orchestrator:
    """The Orchestrator's scheduling state alone: no run directory, servers or sockets."""
    overrides = {"num_steps": steps, "orchestrate.max_async": max_async}
    if bound is not None:
        overrides["orchestrate.max_off_policy_steps"] = bound
    cfg = load_recipe(recipe, overrides)
    o = Orchestrator.schedule_only(cfg, load_tokenizer(REPO / cfg.model.path))
    o.zero_variance_cap = 0
    return o


def simulate(recipe: Path, max_async: int, bound: int | None, steps: int, step_s: float, seq_s: float,
             train_s: float, publish_s: float, seed: int = 0) -> dict:
    """One arm. The engine decodes one token of every running completion per step, a step taking
    ``step_s + seq_s * running``; so a completion of L tokens finishes L engine steps after its
    dispatch, however long those steps are."""
    o = orchestrator(recipe, max_async, bound, steps)
    group_size = o.ocfg.group_size
    rng = random.Random(seed)
    default_tokens = o.ocfg.sampling.max_tokens
    finishes: list[tuple[float, int, str, int]] = []  # (engine tokens elapsed at finish, tiebreak, id, length)
    policies: list[tuple[float, int]] = []  # (wall time served, version)
    now = tokens = 0.0  # wall time; engine steps run so far
    trainer_free, written, lags, count = 0.0, [], [], 0

    def dispatch() -> None:
        nonlocal count
        for _ in range(o.num_to_dispatch()):
            task = o.env.sample_task(rng)
            length = task.max_tokens or default_tokens
            count += 1
            o.inflight[str(count)] = Group(task, [0], o.policy_version)
            heapq.heappush(finishes, (tokens + length, count, str(count), length))

    dispatch()
    while o.next_step <= steps:
        step = step_s + seq_s * group_size * len(o.inflight)  # the engine's step now
        t_finish = now + (finishes[0][0] - tokens) * step if finishes else float("inf")
        if policies and policies[0][0] <= t_finish:
            served, version = heapq.heappop(policies)
            tokens += (served - now) / step if finishes else 0.0
            now = served
            o.policy_version = max(o.policy_version, version)
        else:
            tokens, _, rid, length = heapq.heappop(finishes)
            now = t_finish
            group = o.inflight.pop(rid)
            group.completions = [Completion(token_ids=[0] * length, logprobs=[0.0] * length,
                                            versions=[group.dispatch_version] * length, finish_reason="length")]
            group.rewards, group.advantages = [0.0], [0.0]
            o.buffer.append(group)
        while o.next_step <= steps and (batch := o.select_batch()) is not None:
            taken = {id(g) for g in batch}
            o.buffer = [g for g in o.buffer if id(g) not in taken]
            lags += [o.next_step - 1 - g.min_version for g in batch]
            written.append(now)
            trainer_free = max(trainer_free, now) + train_s
            heapq.heappush(policies, (trainer_free + publish_s, o.next_step))
            o.next_step += 1
        dispatch()
    steady = written[len(written) // 10:]
    return {"step_s": (steady[-1] - steady[0]) / (len(steady) - 1), "lag_mean": statistics.fmean(lags),
            "lag_max": max(lags)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", type=Path, default=REPO / "recipes" / "bench-longtail.toml")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--max-async", type=int, nargs="+", default=[2])
    p.add_argument("--bounds", type=int, nargs="+", default=[2, 3, 4, 6, 8],
                   help="orchestrate.max_off_policy_steps values to model for each max_async")
    p.add_argument("--step-ms", type=float, default=2.45, help="the engine's decode step, fixed part")
    p.add_argument("--seq-us", type=float, default=5.0, help="the engine's decode step, per running sequence")
    p.add_argument("--train-ms", type=float, default=100.0, help="trainer time per step")
    p.add_argument("--publish-ms", type=float, default=20.0, help="from a step's end until its policy is served")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    run = lambda k, b: simulate(args.recipe, k, b, args.steps, args.step_ms / 1e3, args.seq_us / 1e6,  # noqa: E731
                                args.train_ms / 1e3, args.publish_ms / 1e3, args.seed)
    sync = run(0, None)
    print(f"# model, {args.steps} steps: engine step {args.step_ms} ms + {args.seq_us} us a sequence, "
          f"{args.train_ms} ms a train step, {args.publish_ms} ms to serve a policy")
    print(f"{'mode':<22}{'step s':>8}{'ratio':>8}{'lag mean':>10}{'lag max':>9}")
    print(f"{'max_async=0':<22}{sync['step_s']:>8.3f}{1:>7.2f}x{sync['lag_mean']:>10.2f}{sync['lag_max']:>9d}")
    for k in args.max_async:
        for b in args.bounds:
            r = run(k, b)
            print(f"{f'max_async={k},bound={b}':<22}{r['step_s']:>8.3f}{sync['step_s'] / r['step_s']:>7.2f}x"
                  f"{r['lag_mean']:>10.2f}{r['lag_max']:>9d}")


if __name__ == "__main__":
    main()
