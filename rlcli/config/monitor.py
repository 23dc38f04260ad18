from typing import Literal

from rlcli.config.base import Config


class MonitorConfig(Config):
    """Where each process's per-step metrics go besides RUN/metrics/<command>.jsonl (always written)."""

    wandb: bool = False
    """Also log to Weights & Biases (needs the `monitor` extra): one W&B run per process, grouped by run directory."""

    wandb_project: str = "rlcli"
    """W&B project."""

    wandb_mode: Literal["online", "offline"] = "online"
    """online streams to the W&B server; offline writes RUN/wandb/ for a later `wandb sync`."""

    tensorboard: bool = False
    """Also write TensorBoard event files to RUN/tensorboard/<command>/ (needs the `monitor` extra)."""
