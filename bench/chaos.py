"""Chaos run: the demo under default retention while every process is killed and restarted.

Runs the five commands (two rl-infer servers) on the demo recipe (recipes/reverse.toml,
default ``keep_weights`` / ``keep_rollouts``, ``checkpoint.interval`` 4 unless told) and,
at seeded random trainer steps, SIGKILLs each process several times and restarts it
alone after a short pause. Some kills are aimed: rl-train while a checkpoint or weights
temporary directory exists (mid-write), rl-infer while its start-up pin exists (mid
weight load). One rl-infer is SIGSTOPped for ``--stop-s`` (longer than the liveness
window) and continued. The SIGSTOP and rl-orchestrate's kills fall in the first half of the
steps (rl-orchestrate finishes max_async steps before the trainer). A monitor samples the run
directory every 20 ms.

The audit at the end (printed as JSON, last line a table):

- every step 1..N trained, each on the batch the orchestrator wrote for it, byte for byte (the
  checksum of rank 0's file that rl-train read equals the one rl-orchestrate wrote; a step whose
  work a trainer kill lost since its checkpoint is trained again from the same batch:
  counted as ``steps_redone``);
- no ``step_N`` directory left without its marker (a deletion killed midway);
- with ``--eval-interval``, each evaluated policy recorded once in metrics/eval.jsonl, the final one too;
- every batch written once (its STABLE marker never changes) and no step skipped;
- the last step's weights published (STABLE), however the trainer's last kill fell;
- policy versions monotone (rl-sync's live policy, and each server's served version);
- no temporary directories left anywhere in the run directory;
- every STABLE weights, checkpoint and rollout directory left intact: each file's size
  and checksum against its manifest, and each marker's own checksum;
- reward rising: mean reward of the last fifth of the steps above the first fifth (judged
  from 40 steps on; a shorter run only reports it).

The baseline beside it is the same job without chaos (``--baseline``, off by default to
save time): its reward curve and wall time.

    python bench/chaos.py --steps 120 --kills 3            # the recorded run
    python bench/chaos.py --smoke                          # short setting (tests/test_chaos.py)
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlcli.config import dump_toml  # noqa: E402
from rlcli.transport.rundir import RunDir  # noqa: E402

MODULES = {"infer": ["rlcli.cli.infer", "serve"], "train": ["rlcli.cli.train", "run"], "sync": ["rlcli.cli.sync"],
           "cache": ["rlcli.cli.cache", "serve"], "orchestrate": ["rlcli.cli.orchestrate", "run"]}
NAMES = ("cache", "train", "sync", "infer-0", "infer-1", "orchestrate")
FINITE = ("train", "orchestrate")  # done when they exit 0
MIN_STEPS_FOR_REWARD = 40  # below this the reward trend is noise: reported, not judged


def write_recipe(args, run_dir: Path) -> Path:
    tree = tomllib.loads((REPO / "recipes" / "reverse.toml").read_text())
    tree["run_dir"] = str(run_dir)
    tree["num_steps"] = args.steps
    tree["seed"] = args.seed
    tree["model"]["path"] = str(REPO / tree["model"]["path"])
    tree["train"]["sft"]["num_steps"] = args.sft_steps
    tree["train"].setdefault("checkpoint", {})["interval"] = args.checkpoint_interval
    if args.batch_size:
        tree["orchestrate"]["batch_size"] = args.batch_size
    if args.eval_interval:
        tree["orchestrate"]["eval"] = {"interval": args.eval_interval, "num_tasks": 16}
    path = run_dir.parent / f"{run_dir.name}.toml"
    path.write_text(dump_toml(tree))
    return path


class Fleet:
    """The processes, each its own session (killed as a group), logged per start."""

    def __init__(self, recipe: Path, log_dir: Path):
        self.recipe, self.log_dir = recipe, log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}

    def start(self, name: str) -> None:
        role = name.split("-")[0]
        self.starts[name] = self.starts.get(name, 0) + 1
        log = open(self.log_dir / f"{name}.{self.starts[name]}.log", "wb")
        extra = ["--id", name.split("-")[1]] if role == "infer" else []
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", *MODULES[role], "--config", str(self.recipe), *extra], stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def running(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def signal(self, name: str, sig: int) -> None:
        try:
            os.killpg(self.procs[name].pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            self.procs[name].wait()

    def stop_all(self) -> None:
        for name in reversed(NAMES):
            if self.running(name):
                self.signal(name, signal.SIGCONT)
                self.signal(name, signal.SIGTERM)
        for name, p in self.procs.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.signal(name, signal.SIGKILL)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_jsonl(path: Path) -> list[dict]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def temporaries(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name)


class Monitor:
    """Samples the run directory: policy versions, served versions, batch markers."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.policy: list[int] = []
        self.served: dict[str, list[int]] = {}
        self.batch_marks: dict[int, float] = {}
        self.rewritten: set[int] = set()

    def sample(self) -> None:
        v = read_json(self.run_dir / "progress" / "sync.json").get("version")
        if v is not None and (not self.policy or self.policy[-1] != v):
            self.policy.append(int(v))
        for path in (self.run_dir / "registry").glob("infer-*.json"):
            served = read_json(path).get("info", {}).get("version")
            seq = self.served.setdefault(path.stem, [])
            if served is not None and (not seq or seq[-1] != served):
                seq.append(int(served))
        for marker in (self.run_dir / "rollouts").glob("step_*/STABLE"):
            step = int(marker.parent.name.removeprefix("step_"))
            t = read_json(marker).get("time")
            if t is not None and self.batch_marks.setdefault(step, t) != t:
                self.rewritten.add(step)

    def trained(self) -> int:
        return int(read_json(self.run_dir / "progress" / "train.json").get("step", 0))


def plan(args) -> list[dict]:
    """Seeded kill events: (trainer step that arms it, process, aim)."""
    rng = random.Random(args.seed)
    lo, hi = 2, max(3, args.steps - 2)
    events = [{"name": "infer-1", "aim": "SIGSTOP"}]
    for name in NAMES:
        aims = ["any"] * args.kills
        if name == "train":
            aims[0] = "checkpoint write"
            if args.kills > 1:
                aims[1] = "weights write"
        if name.startswith("infer") and args.kills > 1:
            aims[1] = "weight load"
        events += [{"name": name, "aim": aim} for aim in aims]
    rng.shuffle(events)
    # Distinct steps where there are enough.
    steps = sorted(rng.sample(range(lo, hi + 1), len(events)) if hi - lo + 1 >= len(events)
                   else [rng.randint(lo, hi) for _ in events])
    for e, s in zip(events, steps):
        e["at_step"] = s
    # The SIGSTOP in the first half, so the run outlasts it; rl-orchestrate's kills too: it is done once
    # it has written the last batch, max_async steps before the trainer's last, and events are armed one
    # at a time (held up behind a stopped rl-infer's, behind restarts), so a kill planned late found it
    # gone and was skipped.
    for e in events:
        if e["aim"] == "SIGSTOP" or e["name"] == "orchestrate":
            e["at_step"] = min(e["at_step"], max(lo, args.steps // 2))
    return sorted(events, key=lambda e: e["at_step"])


def aimed(run_dir: Path, name: str, aim: str) -> bool:
    if aim == "checkpoint write":
        return any(".tmp-" in p.name for p in (run_dir / "checkpoints").iterdir())
    if aim == "weights write":
        return any(".tmp-" in p.name for p in (run_dir / "weights").iterdir())
    if aim == "weight load":
        return (run_dir / "weights" / ".pins" / f"{name}.json").exists()
    return True


def chaos(args, run_dir: Path, fleet: Fleet, mon: Monitor) -> dict:
    rng = random.Random(args.seed + 1)
    events = plan(args) if not args.no_chaos else []
    pending_restarts: dict[str, float] = {}
    stopped_until: float | None = None
    done: list[dict] = []
    crashes: list[dict] = []
    armed: dict | None = None
    deadline = time.monotonic() + args.timeout
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        mon.sample()
        now = time.monotonic()
        for name, when in list(pending_restarts.items()):
            if now >= when:
                fleet.start(name)
                del pending_restarts[name]
                if armed and armed["name"] == name and armed["aim"] == "weight load":
                    armed["since"] = now  # the load happens during this start
        if stopped_until is not None and now >= stopped_until:
            fleet.signal("infer-1", signal.SIGCONT)
            stopped_until = None
        for name in NAMES:  # an exit nobody caused is a crash: recorded, and restarted like a kill
            code = fleet.procs[name].poll()
            if code is not None and name not in pending_restarts and (code != 0 or name not in FINITE):
                crashes.append({"name": name, "exit": code, "start": fleet.starts[name]})
                pending_restarts[name] = now + 1.0
        trained = mon.trained()
        if (armed is None and events and trained >= events[0]["at_step"] and not pending_restarts
                and not (stopped_until is not None and events[0]["name"] == "infer-1")):
            armed = {**events.pop(0), "since": now}
            if armed["aim"] == "weight load":  # kill it once now, then again while the restart loads
                fleet.signal(armed["name"], signal.SIGKILL)
                done.append({"name": armed["name"], "aim": "any", "at_step": trained, "hit": True})
                pending_restarts[armed["name"]] = now + 0.2
        if armed is not None and armed["name"] not in pending_restarts:
            name, aim = armed["name"], armed["aim"]
            if not fleet.running(name) and name in ("train", "orchestrate"):
                armed = None  # finished its work: nothing left to kill
            elif aim == "SIGSTOP":
                fleet.signal(name, signal.SIGSTOP)
                stopped_until = now + args.stop_s
                done.append({"name": name, "aim": aim, "at_step": trained, "hit": True})
                armed = None
            elif aimed(run_dir, name, aim) or now - armed["since"] > args.aim_timeout_s:
                hit = aim == "any" or aimed(run_dir, name, aim)
                fleet.signal(name, signal.SIGKILL)
                done.append({"name": name, "aim": aim, "at_step": trained, "hit": hit})
                pending_restarts[name] = now + rng.uniform(0.2, 2.0)
                armed = None
        if (not events and armed is None and not pending_restarts and stopped_until is None
                and not fleet.running("train") and not fleet.running("orchestrate")):
            break
        time.sleep(0.02)
    return {"kills": done, "crashes": crashes, "wall_s": time.monotonic() - t0,
            "timed_out": time.monotonic() >= deadline}


def unmarked(run_dir: Path) -> list[str]:
    """``step_*`` directories without their STABLE marker: a deletion killed midway (readers skip
    them, and nothing would ever remove them)."""
    from rlcli.transport.atomic import is_stable

    return [f"{kind}/{d.name}" for kind in ("weights", "checkpoints", "rollouts")
            for d in sorted((run_dir / kind).glob("step_*")) if d.is_dir() and not is_stable(d)]


def damaged(run_dir: Path) -> list[str]:
    """Every STABLE weights, checkpoint and rollout directory left, checked in full against its
    manifest (sizes and checksums of every file, the marker's own checksum): what survived the
    kills must be intact."""
    from rlcli.transport.atomic import is_stable, verify_files

    out = []
    for kind in ("weights", "checkpoints", "rollouts"):
        for d in sorted((run_dir / kind).glob("step_*")):
            if is_stable(d):
                out += [f"{kind}/{d.name}: {p}" for p in verify_files(d)]
    return out


def audit(run_dir: Path, steps: int, mon: Monitor, evaluated: bool = False) -> dict:
    train = read_jsonl(run_dir / "metrics" / "train.jsonl")
    evals = [m["step"] for m in read_jsonl(run_dir / "metrics" / "eval.jsonl")] if evaluated else []
    orch = [m for m in read_jsonl(run_dir / "metrics" / "orchestrate.jsonl") if not m.get("rewritten")]
    by_step: dict[int, list[dict]] = {}
    for m in train:
        by_step.setdefault(m["step"], []).append(m)
    written = {m["step"]: m for m in orch}
    # The bytes of rank 0's file (its manifest checksum), where both sides logged it; else the shape.
    ident = lambda m: m.get("batch_checksum") or (m["num_samples"], m["min_version"], m["max_version"])  # noqa: E731
    same_batch = all(len({ident(m) for m in ms}) == 1 and (s not in written or ident(written[s]) == ident(ms[0]))
                     for s, ms in by_step.items())
    rewards = [written[s]["reward_mean"] for s in sorted(written)]
    fifth = max(1, len(rewards) // 5)
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    monotone = all(a <= b for a, b in zip(mon.policy, mon.policy[1:])) and all(
        all(a <= b for a, b in zip(seq, seq[1:])) for seq in mon.served.values())
    checks = {
        "every_step_trained": sorted(by_step) == list(range(1, steps + 1)),
        "final_policy_published": RunDir(run_dir).latest_stable("weights") == steps,
        "each_step_on_its_own_batch": same_batch,
        "every_batch_written_once": not mon.rewritten and sorted(Counter(m["step"] for m in orch).values())[-1:] == [1],
        "weights_monotone": monotone,
        "no_temporaries": not temporaries(run_dir),
        "no_unmarked_steps": not unmarked(run_dir),
        "stable_files_intact": not damaged(run_dir),
        "reward_rising": last > first if steps >= MIN_STEPS_FOR_REWARD else None,
        # orchestrate.eval: each evaluated policy recorded once, the final one among them.
        "evaluations_once_each": len(evals) == len(set(evals)) if evals else None,
        "final_policy_evaluated": steps in evals if evaluated else None,
    }
    return {"checks": checks, "ok": all(v is not False for v in checks.values()),
            "steps_redone": sum(len(ms) - 1 for ms in by_step.values()),
            "reward_first_fifth": round(first, 3), "reward_last_fifth": round(last, 3),
            "policy_versions_seen": len(mon.policy), "temporaries": temporaries(run_dir), "unmarked": unmarked(run_dir),
            "damaged": damaged(run_dir),
            "rewritten_batches": sorted(mon.rewritten)}


def one_run(args, run_dir: Path) -> dict:
    recipe = write_recipe(args, run_dir)
    fleet = Fleet(recipe, run_dir.parent / f"{run_dir.name}-logs")
    mon = Monitor(run_dir)
    try:
        for name in NAMES:
            fleet.start(name)
        result = chaos(args, run_dir, fleet, mon)
    finally:
        fleet.stop_all()
    result["audit"] = audit(run_dir, args.steps, mon, evaluated=bool(args.eval_interval))
    result["restarts"] = {k: v - 1 for k, v in fleet.starts.items()}
    logs = "".join(p.read_text(errors="replace") for p in fleet.log_dir.glob("*.log"))
    result["detected"] = {"dead_or_stopped_lines": logs.count("is dead or stopped"),
                          "skipped_by_sync": logs.count("skipped until it answers"),
                          "redispatched_lines": logs.count("re-dispatching"),
                          "predecessor_aborts": logs.count("of a previous client"),
                          "tracebacks": logs.count("Traceback")}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kills", type=int, default=3, help="SIGKILLs per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=75)
    p.add_argument("--batch-size", type=int, default=0, help="orchestrate.batch_size [default: the recipe's]")
    p.add_argument("--checkpoint-interval", type=int, default=4)
    p.add_argument("--eval-interval", type=int, default=0,
                   help="orchestrate.eval.interval (16 tasks): evaluations beside the kills [default: none]")
    p.add_argument("--stop-s", type=float, default=15.0, help="SIGSTOP duration of one rl-infer")
    p.add_argument("--aim-timeout-s", type=float, default=30.0, help="give up aiming a kill after this long")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--baseline", action="store_true", help="also run the same job without chaos (after it)")
    p.add_argument("--no-chaos", action="store_true", help="only the baseline")
    p.add_argument("--smoke", action="store_true", help="short setting: 14 steps, 1 kill each, 12 s stop")
    args = p.parse_args()
    # The fleet runs in sessions of its own: on a SIGTERM (an outer `timeout`) unwind, so one_run's
    # finally stops it instead of leaving six process groups running in the run directory.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.smoke:
        args.steps, args.kills, args.sft_steps, args.stop_s, args.batch_size = 14, 1, 10, 12.0, 16
        args.aim_timeout_s = 20.0
    import tempfile

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rlcli-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    if not args.no_chaos:
        out["chaos"] = one_run(args, work / "chaos")
    if args.baseline or args.no_chaos:
        args.no_chaos = True
        out["baseline"] = one_run(args, work / "baseline")
    print(json.dumps(out, indent=1))
    print(f"{'run':<9} {'steps':>5} {'SIGKILLs':>8} {'aimed hit':>9} {'SIGSTOP':>7} {'redone':>6} "
          f"{'reward first->last fifth':>25} {'wall s':>7}  audit")
    for name, r in out.items():
        k = r["kills"]
        a = r["audit"]
        print(f"{name:<9} {args.steps:>5} {sum(x['aim'] != 'SIGSTOP' for x in k):>8} "
              f"{sum(x['hit'] and x['aim'] not in ('any', 'SIGSTOP') for x in k):>9} "
              f"{sum(x['aim'] == 'SIGSTOP' for x in k):>7} {a['steps_redone']:>6} "
              f"{a['reward_first_fifth']:>12.3f} -> {a['reward_last_fifth']:<10.3f} {r['wall_s']:>7.0f}  "
              f"{'ok' if a['ok'] else 'FAILED ' + ','.join(n for n, v in a['checks'].items() if v is False)}")
    if len(out) == 2:
        c, b = out["chaos"], out["baseline"]
        gain = lambda r: r["audit"]["reward_last_fifth"] - r["audit"]["reward_first_fifth"]  # noqa: E731
        print(f"chaos / baseline: wall {c['wall_s'] / b['wall_s']:.2f}x, reward gain {gain(c):+.3f} vs {gain(b):+.3f}")
    return 0 if all(r["audit"]["ok"] and not r["timed_out"] and not r["crashes"] for r in out.values()) and \
        ("chaos" not in out or out["chaos"]["kills"]) else 1


if __name__ == "__main__":
    sys.exit(main())
