"""Liveness from the work loops, on real processes: a SIGSTOPped rl-infer is reported dead or
stopped by `rl-orchestrate status` and dropped by the orchestrator's pool with one line
naming it; after SIGCONT it is alive again. (RLCLI_STALE_AFTER_S shortens the window.)"""

import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from procs import Procs, serve_initial_policy, wait_until, write_recipe
from rlcli.orchestrate.entrypoints import status as run_status
from rlcli.orchestrate.pool import InferPool
from rlcli.transport import registry
from rlcli.transport.rundir import RunDir

pytestmark = pytest.mark.timeout(180)


def status(run_dir) -> dict:
    if not (run_dir / "run.json").is_file():
        return {}
    return {p["key"]: p for p in run_status(run_dir)["processes"]}


def status_cli(run_dir, *args) -> str:
    out = subprocess.run([sys.executable, "-m", "rlcli.cli.orchestrate", "status", str(run_dir), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_stopped_server_is_reported_and_dropped_then_comes_back(tmp_path, tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setenv("RLCLI_STALE_AFTER_S", "2")
    monkeypatch.setattr(registry, "STALE_AFTER_S", 2.0)
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir)
    serve_initial_policy(run_dir, tiny_model_dir)
    procs = Procs(tmp_path / "logs")
    try:
        procs.start("infer-0", recipe, "--id", "0")
        procs.start("cache", recipe)
        wait_until(lambda: {"infer-0", "cache-0"} <= {k for k, p in status(run_dir).items() if p["state"] == "alive"},
                   120, "both processes alive", procs)
        assert status(run_dir)["infer-0"]["version"] == 0
        # The watched dashboard (not a terminal: it prints the process table whenever a state changes).
        shown_path = tmp_path / "watch.txt"
        watcher = subprocess.Popen([sys.executable, "-m", "rlcli.cli.orchestrate", "status", str(run_dir),
                                    "--watch", "0.2"], stdout=subprocess.DEVNULL, stderr=open(shown_path, "w"),
                                   env={**os.environ, "COLUMNS": "200"})
        wait_until(lambda: "infer-0" in shown_path.read_text(), 60, "the dashboard's first table")
        pool = InferPool(RunDir(run_dir), [], request_timeout_s=300)
        pool.refresh()
        assert list(pool.servers) == ["infer-0"]

        os.killpg(procs.procs["infer-0"].pid, signal.SIGSTOP)
        try:
            wait_until(lambda: status(run_dir)["infer-0"]["state"] == "dead or stopped", 60, "infer-0 reported", procs)
            cli = {p["key"]: p for p in json.loads(status_cli(run_dir, "--json"))["processes"]}
            assert cli["infer-0"]["state"] == "dead or stopped" and cli["cache-0"]["state"] == "alive"
            table = status_cli(run_dir).splitlines()
            assert any(line.startswith("infer-0") and "dead or stopped" in line for line in table), table
            with caplog.at_level(logging.WARNING):
                wait_until(lambda: (pool.refresh(), not pool.servers)[1], 30, "the pool drops infer-0")
            lines = [r.getMessage() for r in caplog.records if "infer-0" in r.getMessage()]
            pid = procs.procs["infer-0"].pid
            assert len(lines) == 1 and f"infer-0 (pid {pid} on " in lines[0] and "dead or stopped" in lines[0], lines
        finally:
            os.killpg(procs.procs["infer-0"].pid, signal.SIGCONT)
        wait_until(lambda: status(run_dir)["infer-0"]["state"] == "alive", 60, "infer-0 alive again", procs)
        pool.close()
        import time

        time.sleep(1.0)  # a few redraws after the change
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=30) == 0, shown_path.read_text()
        shown = shown_path.read_text()
        states = [("dead or stopped" if "dead or stopped" in line else "alive")
                  for line in shown.splitlines() if "infer-0" in line and ("alive" in line or "dead" in line)]
        assert states[0] == "alive" and "dead or stopped" in states and states[-1] == "alive", shown
    finally:
        procs.stop_all()


def test_status_shows_what_each_server_is_doing(tmp_path):
    """A server below the live policy is 'behind' (rl-orchestrate sends it nothing); one that generated
    in the last minute shows its tokens per second from its newest metrics record."""
    import time

    from rlcli.orchestrate.entrypoints import render_status
    from rlcli.transport.registry import Registration
    from rlcli.transport.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.claim("t", {})
    run.write_progress("sync", version=5)
    regs = [Registration(run.registry_dir(), "infer", i, {"rpc": "tcp://127.0.0.1:1"}, {"version": v})
            for i, v in enumerate([3, 5, 5])]
    run.append_metrics("infer-1", {"step": 1, "time": time.time() - 5, "gen_tokens_per_s": 1234.4})
    run.append_metrics("infer-2", {"step": 1, "time": time.time() - 600, "gen_tokens_per_s": 99.0})  # stale
    try:
        s = run_status(run.root)
        work = {p["key"]: p["work"] for p in s["processes"]}
        assert work == {"infer-0": "behind v5", "infer-1": "1234 tok/s", "infer-2": None}
        table = render_status(s)
        assert "behind v5" in table and "1234 tok/s" in table and "eval" not in table
        run.append_metrics("eval", {"step": 4, "samples_per_task": 8, "pass@1": 0.25, "pass@8": 0.5,
                                    "reward_mean": 0.4, "num_tasks": 64})
        s = run_status(run.root)
        assert s["eval"]["step"] == 4
        assert "eval of v4: pass@1 0.250, pass@8 0.500, reward 0.400 over 64 tasks" in render_status(s)
    finally:
        for reg in regs:
            reg.close()
