"""Metric sinks: Weights & Biases and TensorBoard beside the metrics files.

RUN/metrics/<command>.jsonl stays the record every tool reads (dashboard, plots, benchmarks); a sink
mirrors the numeric fields of each record, at the record's ``step``, into another monitoring system,
and the readable samples a process writes (``orchestrate.log_samples``, an evaluation's completions) as
a table: a W&B ``Table`` under ``<command>/samples``, a TensorBoard text panel of the same name.
Sinks attach to a process's :class:`RunDir` (``open_run`` does it from the recipe's ``[monitor]``
table), so no call site changes. A sink that fails is dropped with one warning: monitoring never
stops a run. Both libraries are optional (the ``monitor`` extra) and imported only when enabled.
"""

import atexit
import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

from rlcli.errors import ConfigError

log = logging.getLogger("rlcli.sinks")


class MetricsSink(Protocol):
    def log(self, command: str, record: dict[str, Any]) -> None: ...

    def log_samples(self, command: str, step: int, records: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


SAMPLE_COLUMNS = ("prompt", "answer", "completion", "reward", "advantage")


def sample_rows(records: list[dict[str, Any]]) -> list[list]:
    """One row per completion of :func:`rlcli.orchestrate.rollouts.write_samples`' records (SAMPLE_COLUMNS)."""
    rows = []
    for r in records:
        advantages = r.get("advantages") or [None] * len(r["completions"])
        for text, reward, advantage in zip(r["completions"], r["rewards"], advantages):
            rows.append([r["prompt"], str(r.get("answer")), text, reward, advantage])
    return rows


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numeric fields of a record (booleans and ``step`` left out)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)}


class WandbSink:
    """One W&B run per process (name ``<recipe>-<process>``, group: the run directory's name), started at
    the first record, so processes that log nothing make no run. Metrics are ``<command>/<metric>``."""

    def __init__(self, run_root: Path, recipe: str, command: str, project: str, mode: str, config: dict):
        try:
            import wandb  # noqa: F401  (fail at start, not at the first record)
        except ImportError:
            raise ConfigError("monitor.wandb needs wandb: pip install 'rlcli[monitor]'") from None
        self.args = dict(project=project, name=f"{recipe}-{command}", group=run_root.name, job_type=command,
                         dir=str(run_root), mode=mode, config=config)
        self.run = None
        self.commands: set[str] = set()

    def _start(self, command: str) -> None:
        """The run, at the first record; each command's own step axis, at its first."""
        if self.run is None:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            Path(self.args["dir"]).mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(**self.args)
        if command not in self.commands:
            # Each command logged by this process (rl-train logs "sft" then "train") keeps its own step
            # axis, so W&B's one monotonic step never drops a record.
            self.run.define_metric(f"{command}/step")
            self.run.define_metric(f"{command}/*", step_metric=f"{command}/step")
            self.commands.add(command)

    def log(self, command: str, record: dict[str, Any]) -> None:
        self._start(command)
        values = {f"{command}/{k}": v for k, v in scalars(record).items()}
        self.run.log({**values, f"{command}/step": int(record.get("step", 0))})

    def log_samples(self, command: str, step: int, records: list[dict[str, Any]]) -> None:
        import wandb

        self._start(command)
        table = wandb.Table(columns=list(SAMPLE_COLUMNS), data=sample_rows(records))
        self.run.log({f"{command}/samples": table, f"{command}/step": step})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class TensorBoardSink:
    """Event files in RUN/tensorboard/<process>/, one scalar tag ``<command>/<metric>`` per metric, opened
    at the first record."""

    def __init__(self, run_root: Path, command: str):
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("monitor.tensorboard needs tensorboard: pip install 'rlcli[monitor]'") from None
        self.log_dir = run_root / "tensorboard" / command
        self.writer = None

    def _open(self) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, command: str, record: dict[str, Any]) -> None:
        self._open()
        step = int(record.get("step", 0))
        for key, value in scalars(record).items():
            self.writer.add_scalar(f"{command}/{key}", value, step)
        self.writer.flush()

    def log_samples(self, command: str, step: int, records: list[dict[str, Any]]) -> None:
        """A markdown table, one row per completion (TensorBoard's text panel)."""
        self._open()
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in sample_rows(records)]
        self.writer.add_text(f"{command}/samples", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def make_sinks(cfg, run_root: Path, command: str) -> list[MetricsSink]:
    """The sinks the recipe's ``[monitor]`` table enables, for process ``command``; closed at exit."""
    from rlcli.config import to_dict

    sinks: list[MetricsSink] = []
    if cfg.monitor.wandb:
        sinks.append(WandbSink(run_root, cfg.name, command, cfg.monitor.wandb_project, cfg.monitor.wandb_mode,
                               to_dict(cfg)))
    if cfg.monitor.tensorboard:
        sinks.append(TensorBoardSink(run_root, command))
    for sink in sinks:
        atexit.register(sink.close)
    return sinks
