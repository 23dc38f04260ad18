"""The live view on stderr: recent steps from RUN/metrics, and the processes of `up` or,
for `rl-orchestrate status RUN --watch`, every registered process's liveness.

On a terminal it is a rich Live table redrawn twice a second; otherwise (logs, CI) each
new step is printed once as a plain line, and the process table whenever a process's
state or version changes.
"""

import json
from dataclasses import dataclass

from rich.console import Group as RichGroup
from rich.live import Live
from rich.table import Table

from rlcli.logging import console
from rlcli.transport.rundir import RunDir


@dataclass
class ProcessRow:
    name: str
    pid: int
    status: str
    log: str


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


class MetricsTail:
    """Complete JSONL records appended to RUN/metrics/<command>.jsonl since the last call
    (a partially written last line waits for the next call)."""

    def __init__(self, run: RunDir, command: str):
        self.path = run.metrics_file(command)
        self.offset = 0

    def read_new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


def steps_table(run_name: str, orch: dict[int, dict], train: dict[int, dict], last: int = 10) -> Table:
    table = Table(title=f"run {run_name}", title_justify="left", expand=False)
    for col in ("step", "reward", "len trained", "len generated", "dropped", "lag", "tok/s", "orch wait", "loss",
                "mismatch kl", "masked", "train wait"):
        table.add_column(col, justify="right")
    for step in sorted(set(orch) | set(train))[-last:]:
        o, t = orch.get(step, {}), train.get(step, {})
        table.add_row(str(step), _fmt(o.get("reward_mean"), ".3f"), _fmt(o.get("completion_len_mean"), ".1f"),
                      _fmt(o.get("generated_len_mean"), ".1f"), _fmt(o.get("dropped_fraction"), ".1%"),
                      _fmt(o.get("off_policy_lag_max"), "d"), _fmt(o.get("tokens_per_s"), ".0f"),
                      _fmt(o.get("wait_s"), ".2f"), _fmt(t.get("loss"), "+.4f"), _fmt(t.get("mismatch_kl"), ".1e"),
                      _fmt(t.get("masked_fraction"), ".3f"), _fmt(t.get("wait_s"), ".2f"))
    return table


def processes_table(rows: list[ProcessRow]) -> Table:
    table = Table(title="processes", title_justify="left")
    for col in ("process", "pid", "status", "log"):
        table.add_column(col)
    for r in rows:
        style = "green" if r.status == "running" else ("red" if "exit" in r.status and r.status != "exit 0" else "")
        table.add_row(r.name, str(r.pid), f"[{style}]{r.status}[/]" if style else r.status, r.log)
    return table


def liveness_table(status: dict) -> Table:
    """The processes of ``rl-orchestrate status`` (liveness, policy version, lag, heartbeat age)."""
    table = Table(title="processes", title_justify="left")
    for col in ("process", "state", "version", "lag", "silent", "work", "pid@host"):
        table.add_column(col, justify="right" if col in ("version", "lag", "silent") else "left")
    for p in status["processes"]:
        style = {"alive": "green", "busy": "yellow"}.get(p["state"], "red")
        table.add_row(p["key"], f"[{style}]{p['state']}[/]", _fmt(p.get("version"), "d"), _fmt(p.get("lag"), "d"),
                      f"{p['heartbeat_age_s']:.1f}s", p.get("work") or "-", f"{p['pid']}@{p['host']}")
    return table


class LiveView:
    """Redraws on a terminal; prints one line per new step otherwise."""

    def __init__(self, run: RunDir):
        self.run = run
        self.live = Live(console=console, refresh_per_second=2, transient=False) if console.is_terminal else None
        self.orch_tail, self.train_tail = MetricsTail(run, "orchestrate"), MetricsTail(run, "train")
        self.orch: dict[int, dict] = {}
        self.train: dict[int, dict] = {}
        self._states: list | None = None  # the process states last printed (plain mode)

    def __enter__(self) -> "LiveView":
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, processes: list[ProcessRow] | None = None, status: dict | None = None) -> None:
        """``processes``: the children of `up`; ``status``: ``rl-orchestrate status``'s dict."""
        new_orch = self.orch_tail.read_new()
        if self.live:
            for m in new_orch:
                self.orch[m["step"]] = m
            for m in self.train_tail.read_new():
                self.train[m["step"]] = m
            parts = [steps_table(self.run.root.name, self.orch, self.train)]
            parts += [processes_table(processes)] if processes else []
            parts += [liveness_table(status)] if status else []
            self.live.update(RichGroup(*parts))
            return
        if status is not None:
            states = [(p["key"], p["state"], p.get("version")) for p in status["processes"]]
            if states != self._states:
                self._states = states
                console.print(liveness_table(status))
        for m in new_orch:
            console.print(f"step {m['step']:>4}  reward {m['reward_mean']:.3f}  len {m['completion_len_mean']:.1f} "
                          f"(generated {m.get('generated_len_mean', 0):.1f})  dropped {m.get('dropped_fraction', 0):.1%}"
                          f"  lag {m['off_policy_lag_max']}  tok/s {m['tokens_per_s']:.0f}")
