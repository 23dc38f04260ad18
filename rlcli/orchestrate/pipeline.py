"""Pipeline commands: environments as filters over JSON lines.

    rl-orchestrate tasks --env reverse -n 64 | rl-infer generate --run-dir RUN --json \\
        | rl-orchestrate score --env reverse | jq .reward_mean

``tasks`` writes one object per task (``prompt``, ``answer``, ``info``); ``rl-infer generate --json``
keeps every field of an input object and adds the completions; ``score`` adds ``rewards`` (one per
completion) and ``reward_mean``. ``eval`` does all three against a live rl-infer and reports pass@k.
Each object travels whole, so any tool (jq, a notebook) can join the stream at any point.
"""

import json
import random
import sys
from typing import Any, Iterable, Iterator, TextIO

from rlcli.envs import Task, is_multi_turn, make_env
from rlcli.envs.runner import call, check_reward, describe, log
from rlcli.errors import ConfigError
from rlcli.transport.jsonl import json_objects


def task_record(task: Task) -> dict[str, Any]:
    return {"prompt": task.prompt, "answer": task.answer, "info": task.info,
            **({"max_tokens": task.max_tokens} if task.max_tokens else {})}


def sample_tasks(env_cfg, num_tasks: int, seed: int) -> Iterator[dict[str, Any]]:
    env, rng = make_env(env_cfg), random.Random(seed)
    for _ in range(num_tasks):
        yield task_record(env.sample_task(rng))


def read_records(stream: TextIO) -> Iterator[dict[str, Any]]:
    """JSON objects, one per non-empty line; a line that is not one is an error naming it."""
    for _, obj in json_objects(stream, "stdin"):
        yield obj


def score_records(env_cfg, records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each record with ``rewards`` for its ``completions`` under the environment's reward (a
    multi-turn environment scores each completion as a one-turn episode). A reward that fails
    is run again up to ``env.retries`` times, then logged with the environment's name and scored
    ``env.on_error``."""
    env = make_env(env_cfg)
    multi_turn = is_multi_turn(env)

    def score(task: Task, text: str) -> float:
        for attempt in range(env_cfg.retries + 1):
            try:
                return call(env.reward, (task, [{"role": "assistant", "content": text}] if multi_turn else text),
                            check_reward)
            except Exception as e:  # the environment's failure: tried again (env.retries), then scored
                if attempt < env_cfg.retries:
                    log.warning("env %s: reward failed (%s); trying again (%d of env.retries=%d)", env_cfg.name,
                                describe(e), attempt + 1, env_cfg.retries)
                    continue
                log.warning("env %s: reward failed (%s); scored %r", env_cfg.name, describe(e), env_cfg.on_error)
        return env_cfg.on_error

    for number, rec in enumerate(records, 1):
        completions = rec.get("completions")
        if isinstance(completions, str):
            completions = [completions]
        if not isinstance(completions, list) or "prompt" not in rec:
            raise ConfigError(f"record {number} needs 'prompt' and 'completions' (as `rl-infer generate --json` "
                              "writes them)")
        bad = next((c for c in completions if not isinstance(c, str)), None) if completions else None
        if bad is not None or not isinstance(rec["prompt"], str):  # else scored env.on_error, as if it failed
            what = "'prompt'" if bad is None else "each of 'completions'"
            got = type(rec["prompt"] if bad is None else bad).__name__
            raise ConfigError(f"record {number}: {what} must be a string, got {got}")
        task = Task(prompt=rec["prompt"], answer=rec.get("answer"), info=rec.get("info") or {})
        rewards = [score(task, text) for text in completions]
        yield {**rec, "rewards": rewards, "reward_mean": sum(rewards) / len(rewards) if rewards else None}


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if num_samples - num_correct < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(num_samples - num_correct + 1, num_samples + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def summarize_eval(scored: list[dict[str, Any]], k: int, threshold: float) -> dict[str, Any]:
    """pass@1..k (a completion passes when its reward >= threshold), mean reward and the policy versions seen."""
    versions = sorted({v for rec in scored for vs in rec.get("versions", []) for v in vs})
    ks = sorted({1, k})
    out: dict[str, Any] = {"num_tasks": len(scored), "samples_per_task": k, "threshold": threshold,
                           "reward_mean": sum(r["reward_mean"] for r in scored) / len(scored) if scored else None,
                           "policy_versions": versions}
    for kk in ks:
        out[f"pass@{kk}"] = (sum(pass_at_k(len(r["rewards"]), sum(x >= threshold for x in r["rewards"]), kk)
                                 for r in scored) / len(scored)) if scored else None
    return out


def write_records(records: Iterable[dict[str, Any]], stream: TextIO | None = None) -> None:
    stream = stream if stream is not None else sys.stdout  # looked up now: a caller may have replaced it
    for rec in records:
        stream.write(json.dumps(rec, sort_keys=True) + "\n")
        stream.flush()
