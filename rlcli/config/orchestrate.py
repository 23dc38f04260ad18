import math
from typing import Any, Optional

import msgspec

from rlcli.config.base import Config


class SamplingConfig(Config):
    """Sampling parameters of every generation request."""

    temperature: float = 1.0
    """Softmax temperature; the trainer recomputes logprobs at the same temperature."""

    top_p: float = 1.0
    """Nucleus sampling mass; the engine reports logprobs of the truncated distribution and the
    trainer recomputes the same truncation, so importance ratios stay unbiased."""

    max_tokens: int = 32
    """Most tokens per completion (per model turn); a task's own ``max_tokens`` replaces it."""

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"orchestrate.sampling.temperature must be > 0 and finite for RL, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"orchestrate.sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError("orchestrate.sampling.max_tokens must be >= 1")


class AdvantageConfig(Config):
    """Group-relative advantages."""

    std_normalize: bool = False
    """Divide by the group's reward std (GRPO); off gives Dr. GRPO's mean-centred advantages."""

    skip_zero_variance: bool = False
    """Drop groups whose rewards are all equal (they carry no gradient) and sample replacements."""

    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a completion within this many tokens of its max_tokens loses
    reward linearly, up to overlong_penalty at max_tokens, before its advantage is taken (the logged
    rewards stay the environment's). Single-turn environments; 0: off."""

    overlong_penalty: float = 1.0
    """The most reward a completion loses to overlong_buffer (at its max_tokens)."""

    max_zero_variance_drops: int = -1
    """Most zero-variance groups dropped per step; beyond it they join the batch anyway (so a
    saturated task set cannot stall the run; reported as num_zero_variance_kept). -1: 2 x batch_size."""

    def __post_init__(self) -> None:
        if self.overlong_buffer < 0:
            raise ValueError(f"orchestrate.advantage.overlong_buffer must be >= 0 (0: off), got {self.overlong_buffer}")
        if not (self.overlong_penalty >= 0 and math.isfinite(self.overlong_penalty)):
            raise ValueError(f"orchestrate.advantage.overlong_penalty must be >= 0 and finite, got "
                             f"{self.overlong_penalty}")
        if self.max_zero_variance_drops < -1:
            raise ValueError(f"orchestrate.advantage.max_zero_variance_drops must be >= 0 or -1 (2 x batch_size), "
                             f"got {self.max_zero_variance_drops}")


class EvalConfig(Config):
    """Evaluation during training: every ``interval`` policy versions, rl-orchestrate samples a fixed
    set of the environment's tasks under the policy the servers serve, scores them as training
    episodes are scored, and appends pass@1, pass@k and the mean reward to RUN/metrics/eval.jsonl
    (the completions to RUN/evals/policy_<version>.jsonl). The requests share the servers with
    training's but never join a batch or count against max_async."""

    interval: int = 0
    """Evaluate policy 0 and then the served policy each time it crosses a multiple of this; 0: off."""

    num_tasks: int = 64
    """Tasks per evaluation, drawn once with ``seed`` (the same tasks for every version)."""

    samples: int = 4
    """Completions per task: pass@1 and pass@samples are reported."""

    temperature: float = 1.0
    """Sampling temperature of evaluation requests."""

    top_p: float = 1.0
    """Nucleus mass of evaluation requests."""

    max_tokens: int = 0
    """Most tokens per completion (per model turn); 0: orchestrate.sampling.max_tokens. A task's own
    ``max_tokens`` replaces it, as in training."""

    threshold: float = 1.0
    """A completion passes when its reward is >= this."""

    seed: int = 1234
    """Task-sampling seed (rl-orchestrate eval's default: the same tasks as that command's)."""

    final: bool = True
    """Also evaluate the final policy (version num_steps): after the last batch, rl-orchestrate waits
    for the servers to serve it, evaluates it, then exits."""

    env: str = ""
    """Evaluate on this environment instead of the training one (named as env.name names one: a held-out
    split, a harder setting, another task), with env_args; the [env] table's other settings apply."""

    env_args: dict[str, Any] = {}
    """Its factory's keyword arguments (with eval.env)."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"orchestrate.eval.interval must be >= 0 (0: off), got {self.interval}")
        if self.num_tasks < 1 or self.samples < 1:
            raise ValueError("orchestrate.eval.num_tasks and orchestrate.eval.samples must be >= 1")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"orchestrate.eval.temperature must be > 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"orchestrate.eval.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0:
            raise ValueError(f"orchestrate.eval.max_tokens must be >= 0 (0: orchestrate.sampling.max_tokens), "
                             f"got {self.max_tokens}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"orchestrate.eval.threshold must be a finite reward, got {self.threshold}")

    def sampling(self, train: SamplingConfig) -> SamplingConfig:
        """The evaluation's sampling settings (max_tokens 0 takes ``train``'s)."""
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p,
                              max_tokens=self.max_tokens or train.max_tokens)


class TeacherConfig(Config):
    """On-policy distillation: a teacher model, served by rl-infer servers of its own (vLLM only for a
    student sampled at temperature 1), scores every token of each training completion, and
    ``coef * (teacher logprob - inference logprob)``, a per-token estimate of the reverse KL to the
    teacher, is added to that token's advantage. The
    teacher must share the student's tokenizer, and its model.max_seq_len must exceed the student's
    longest episode (prompt and completion, plus the one token a request generates)."""

    connect: list[str] = []
    """Teacher rl-infer endpoints (tcp://host:port)."""

    run_dir: str = ""
    """Or the teacher servers' own run directory, whose registry lists them (rl-infer --run-dir)."""

    coef: float = 1.0
    """Weight of the teacher's per-token term."""

    reward: bool = True
    """Keep the environment's group advantage beside the teacher's term; false: distillation alone."""

    @property
    def enabled(self) -> bool:
        return bool(self.connect or self.run_dir)

    def __post_init__(self) -> None:
        if self.connect and self.run_dir:
            raise ValueError("orchestrate.teacher: give connect or run_dir, not both")
        if not (self.coef >= 0 and math.isfinite(self.coef)):
            raise ValueError(f"orchestrate.teacher.coef must be >= 0 and finite, got {self.coef}")


class OrchestrateConfig(Config):
    """rl-orchestrate: the RL loop."""

    batch_size: int = 16
    """Prompts (groups) per training step."""

    group_size: int = 8
    """Completions sampled per prompt."""

    max_async: int = 1
    """Steps the orchestrator may run ahead of the trainer: requests for batch N go out once
    policy >= N - 1 - max_async is served, so (at the default max_off_policy_steps) batch N is
    sampled from policies >= N - 1 - max_async. 0 is exactly synchronous RL."""

    max_off_policy_steps: Optional[int] = None
    """Batch N takes no group whose oldest token came from a policy older than N - 1 - this
    (defaults to max_async). Below max_async, stragglers past it are dropped; above it, the
    orchestrator still runs at most max_async steps ahead, but a long completion may be
    trained up to this many steps late instead of stalling the batch max_async steps after
    its dispatch (prime-rl's max_off_policy_steps). With max_async = 0 every batch is
    still exactly on-policy."""

    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    """Sampling parameters."""

    advantage: AdvantageConfig = msgspec.field(default_factory=AdvantageConfig)
    """Advantage estimation."""

    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    """Evaluation during training (off unless eval.interval > 0)."""

    teacher: TeacherConfig = msgspec.field(default_factory=TeacherConfig)
    """On-policy distillation from a teacher's servers (off unless connect or run_dir is given)."""

    request_timeout_s: float = 300.0
    """How long an rl-infer server may leave the orchestrator's question "which of these requests
    do you hold?" unanswered (asked every 10 s, or this often if shorter) before its requests are
    aborted there and sent elsewhere. A request its server holds is never timed out, however
    long it decodes; one it does not hold is sent again at its next answer. At start, a --connect
    endpoint that does not answer within 10 s (or this, if shorter) stops the orchestrator."""

    keep_rollouts: int = 8
    """Delete rollout batches this many steps behind the trainer."""

    host: str = "127.0.0.1"
    """Interface the batch-written announcement socket binds to; 0.0.0.0 (every interface) lets
    a trainer on another host subscribe, and peers are told this host's address."""

    connect: list[str] = []
    """Explicit rl-infer endpoints (tcp://host:port); empty discovers them in RUN/registry."""

    num_train_ranks: int = 1
    """Trainer data-parallel ranks; each batch is split into this many balanced files."""

    log_samples: int = 0
    """With each batch written, this many of its groups, decoded, to RUN/samples/step_N.jsonl (prompt,
    answer, completions, rewards, advantages, token versions): what the policy writes and how it is
    scored, for a person or jq to read. 0: none."""

    share_prompts: bool = True
    """Pack each group's prompt once, its completions after it (a prefix-tree attention mask),
    so the trainer computes the prompt once instead of group_size times, and the beginning
    that a row's groups' prompts have in common once per row; false repeats it."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.group_size < 1:
            raise ValueError("orchestrate.batch_size and orchestrate.group_size must be >= 1")
        if self.max_async < 0:
            raise ValueError(f"orchestrate.max_async must be >= 0, got {self.max_async}")
        if self.max_off_policy_steps is not None and self.max_off_policy_steps < 0:
            raise ValueError(f"orchestrate.max_off_policy_steps must be >= 0, got {self.max_off_policy_steps}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"orchestrate.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.keep_rollouts < 0:
            raise ValueError(f"orchestrate.keep_rollouts must be >= 0, got {self.keep_rollouts}")
        if self.log_samples < 0:
            raise ValueError(f"orchestrate.log_samples must be >= 0, got {self.log_samples}")
        if self.num_train_ranks < 1:
            raise ValueError(f"orchestrate.num_train_ranks must be >= 1, got {self.num_train_ranks}")

    @property
    def off_policy_bound(self) -> int:
        """The most policy versions a token of batch N may lag behind N - 1."""
        return self.max_async if self.max_off_policy_steps is None else self.max_off_policy_steps
