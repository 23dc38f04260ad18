import math
from typing import Literal

import msgspec

from rlcli.config.base import Config
from rlcli.config.model import Fp8Config


class OptimConfig(Config):
    """AdamW."""

    lr: float = 1e-5
    """Peak learning rate."""

    beta1: float = 0.9
    """Adam first-moment decay."""

    beta2: float = 0.99
    """Adam second-moment decay."""

    eps: float = 1e-8
    """Adam epsilon."""

    weight_decay: float = 0.0
    """Decoupled weight decay."""

    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps."""

    implementation: Literal["auto", "fused", "foreach"] = "auto"
    """AdamW kernel: fused (one kernel over all parameters), foreach (a few kernels per op);
    auto: fused."""

    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after the warm-up: constant, or a linear or cosine decay from lr to
    min_lr_ratio x lr at the recipe's last step (train.schedule_steps, else num_steps)."""

    min_lr_ratio: float = 0.0
    """Where a decaying schedule ends, as a fraction of lr."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"train.optim.lr (--lr) must be > 0 and finite, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.beta1 < 1:
            raise ValueError(f"train.optim.beta1 must be in [0, 1), got {self.beta1}")
        if not 0 <= self.beta2 < 1:
            raise ValueError(f"train.optim.beta2 must be in [0, 1), got {self.beta2}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"train.optim.eps must be > 0 and finite, got {self.eps}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"train.optim.weight_decay must be >= 0 and finite, got {self.weight_decay}")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"train.optim.max_grad_norm must be >= 0 (0 turns clipping off), got {self.max_grad_norm}")
        if self.warmup_steps < 0:
            raise ValueError(f"train.optim.warmup_steps must be >= 0 (0: no warm-up), got {self.warmup_steps}")


DEFAULT_MASK_LOW = 0.5


BUILTIN_LOSSES = ("icepop", "tis", "dppo")
"""The losses of rlcli.train.loss.LOSSES, by name (the config stays free of torch)."""


class LossConfig(Config):
    """Policy-gradient loss; ``kind`` picks a function from rlcli.train.loss.LOSSES."""

    kind: str = "icepop"
    """icepop: mask tokens whose trainer/inference probability ratio leaves [mask_low, mask_high];
    tis: truncate the ratio at mask_high instead of masking; dppo: mask by how far a token's
    *probability* moved, in the direction its advantage pushes (dppo_mask_low / dppo_mask_high;
    DPPO-Binary-TV, prime-rl 0.6.0's default loss); or ``package.module:function``, a loss of your
    own with the signature of rlcli.train.loss.LossFn (it receives this section, so it can read
    the keys above)."""

    ratio: Literal["token", "sequence"] = "token"
    """token: each token is weighted by its own ratio pi_train / pi_infer; sequence: every token of
    a sequence by the sequence's geometric-mean ratio (GSPO), the gradient still through the token's
    own logprob, so mask_low / mask_high (tis: the truncation at mask_high) keep or drop whole
    sequences. The loss stays normalized by the step's loss tokens either way."""

    mask_low: float = DEFAULT_MASK_LOW
    """Lower bound of the trust interval on pi_train / pi_infer (icepop; tis has none, and refuses
    another value than this default)."""

    mask_high: float = 2.0
    """Upper bound of the trust interval on pi_train / pi_infer."""

    dppo_mask_low: float = 0.2
    """dppo: mask a token of negative advantage whose probability under the trainer is below the
    sampler's by more than this (pi_train - pi_infer < -dppo_mask_low)."""

    dppo_mask_high: float = 0.2
    """dppo: mask a token of positive advantage whose probability under the trainer is above the
    sampler's by more than this (pi_train - pi_infer > dppo_mask_high)."""

    sequence_mask_low: float = 0.0
    """Mask every token of a sequence whose geometric-mean ratio is below this; 0 disables it."""

    sequence_mask_high: float = 0.0
    """Mask every token of a sequence whose geometric-mean ratio is above this; 0 disables it."""

    kl_tau: float = 0.0
    """Weight of a penalty ``kl_tau * (log pi_train - log pi_infer)^2`` on every loss token, kept or
    masked (prime-rl's KL term, from Kimi-K2.5): it pulls the trainer's policy toward the one that
    sampled, which bounds how far a step can move off-policy tokens. 0 disables it (prime-rl's
    default is 1e-3)."""

    entropy_coef: float = 0.0
    """Weight of an entropy bonus on the completion tokens the loss keeps (keeps small policies
    exploring); 0 disables it."""

    entropy_schedule: Literal["constant", "linear"] = "constant"
    """constant: entropy_coef at every step; linear: entropy_coef at RL step 1, falling linearly to 0
    at the recipe's last step (train.schedule_steps, else num_steps): explore early, then sharpen on
    what was learned."""

    def __post_init__(self) -> None:
        if self.kind not in BUILTIN_LOSSES and ":" not in self.kind:
            raise ValueError(f"train.loss.kind {self.kind!r} is not a loss: use {', '.join(BUILTIN_LOSSES)} or "
                             "package.module:function")
        if not (self.kl_tau >= 0 and math.isfinite(self.kl_tau)):
            raise ValueError(f"train.loss.kl_tau must be >= 0 and finite, got {self.kl_tau}")
        if not math.isfinite(self.entropy_coef):
            raise ValueError(f"train.loss.entropy_coef must be finite, got {self.entropy_coef}")
        if not 0 <= self.mask_low < 1 < self.mask_high:
            raise ValueError(
                f"train.loss needs 0 <= mask_low < 1 < mask_high, got {self.mask_low}, {self.mask_high}"
            )
        if self.kind == "tis" and self.mask_low != DEFAULT_MASK_LOW:
            raise ValueError(f"train.loss.mask_low ({self.mask_low}) has no effect with kind = tis, which only "
                             "truncates the ratio at mask_high: remove it or use kind = icepop")
        for key in ("dppo_mask_low", "dppo_mask_high"):
            value = getattr(self, key)
            if not 0 < value <= 1:  # a difference of two probabilities
                raise ValueError(f"train.loss.{key} must be in (0, 1], got {value}")
            if self.kind in ("icepop", "tis") and value != 0.2:  # a loss of your own may read them
                raise ValueError(f"train.loss.{key} ({value}) has no effect with kind = {self.kind}: remove it "
                                 "or use kind = dppo")
        if self.kind == "dppo" and (self.mask_low, self.mask_high) != (DEFAULT_MASK_LOW, 2.0):
            raise ValueError("train.loss.mask_low / mask_high bound the ratio, which kind = dppo does not: "
                             "set dppo_mask_low / dppo_mask_high (bounds on the probability's change) instead")
        if not 0 <= self.sequence_mask_low < 1 or not (self.sequence_mask_high == 0 or self.sequence_mask_high > 1):
            raise ValueError(f"train.loss needs 0 <= sequence_mask_low < 1 and sequence_mask_high = 0 or > 1, got "
                             f"{self.sequence_mask_low}, {self.sequence_mask_high}")


def check_loss_importable(loss: LossConfig) -> None:
    """A loss of your own (``train.loss.kind = package.module:function``) imports and is callable
    (a ConfigError naming the key otherwise); checked before a run directory is claimed."""
    if ":" in loss.kind:
        from rlcli.envs.registry import load_factory

        load_factory(loss.kind, "train.loss.kind", "function")


class SFTConfig(Config):
    """Supervised warm-up (and `rl-train sft`)."""

    num_steps: int = 0
    """Optimizer steps of supervised warm-up before RL step 1; 0 skips it."""

    batch_size: int = 64
    """Examples per SFT step."""

    lr: float = 1e-3
    """SFT learning rate (constant after warm-up)."""

    warmup_steps: int = 10
    """Linear SFT learning-rate warm-up."""

    dataset: str = "env"
    """'env' draws demonstrations from the recipe's environment; otherwise a JSONL file of
    {"prompt": ..., "completion": ...} objects."""

    def __post_init__(self) -> None:
        if self.num_steps < 0:
            raise ValueError(f"train.sft.num_steps must be >= 0 (0 skips the warm-up), got {self.num_steps}")
        if self.batch_size < 1:
            raise ValueError(f"train.sft.batch_size must be >= 1, got {self.batch_size}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"train.sft.lr must be > 0 and finite, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"train.sft.warmup_steps must be >= 0 (0: no warm-up), got {self.warmup_steps}")


class CheckpointConfig(Config):
    """Full trainer state for resume."""

    interval: int = 1
    """Save a checkpoint every this many steps (and always at the last step)."""

    keep: int = 2
    """Keep this many newest checkpoints; older ones are deleted (milestones aside)."""

    keep_every: int = 0
    """Also keep, for good, every checkpoint whose step is a multiple of this (milestones to go back
    to or evaluate later; written only at steps the interval reaches); 0: none."""

    background: bool = True
    """Write each checkpoint on a background thread from a host copy taken in the step (one in
    flight; flushed at exit); sharded trainers (torchrun) copy and write each rank's own shards,
    their writers' collectives on a gloo group of their own. False: written in the step."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"train.checkpoint.interval must be >= 1 (a checkpoint every this many steps), got "
                             f"{self.interval}")
        if self.keep < 1:
            raise ValueError(f"train.checkpoint.keep must be >= 1, got {self.keep}")
        if self.keep_every < 0:
            raise ValueError(f"train.checkpoint.keep_every must be >= 0 (0: no milestones), got {self.keep_every}")


class ParallelConfig(Config):
    """How rl-train's ranks split the work (torchrun's WORLD_SIZE = dp * cp).

    The device mesh has axes ("dp", "cp"). FSDP2 shards parameters over both (dp x cp
    ranks hold disjoint data or disjoint parts of one sequence). Expert parallelism borrows
    ``ep`` of those ranks: experts are split over groups of ``ep`` consecutive ranks of the
    flattened dp x cp axis, and expert weights are FSDP-sharded over the rest.
    """

    dp: int = -1
    """Data-parallel degree; -1 takes what WORLD_SIZE leaves after cp."""

    ep: int = 1
    """Expert-parallel degree (MoE models): must divide dp * cp and the number of experts."""

    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks."""

    cpu_offload: bool = False
    """Keep FSDP2-sharded parameters, gradients and optimizer state in CPU memory (GPU runs)."""

    reshard: Literal["micro_batch", "step"] = "micro_batch"
    """FSDP2 with several micro-batches per step: micro_batch all-gathers each block's parameters
    and reduce-scatters its gradients for every micro-batch; step keeps the parameters gathered
    and the gradients unsharded (fp32) until the step's last micro-batch (one all-gather and one
    reduce-scatter per step, at the memory of unsharded parameters and gradients)."""

    def __post_init__(self) -> None:
        if self.dp == 0 or self.dp < -1:
            raise ValueError(f"train.parallel.dp (--dp) must be >= 1 or -1, got {self.dp}")
        if self.ep < 1 or self.cp < 1:
            raise ValueError(f"train.parallel.ep (--ep) and .cp (--cp) must be >= 1, got {self.ep}, {self.cp}")


class TrainConfig(Config):
    """rl-train."""

    micro_batch_tokens: int = 4096
    """Tokens per packed micro-batch row; sequences are packed into rows of this length."""

    schedule_steps: int = 0
    """The RL step where the schedules end (optim.schedule's decay, loss.entropy_schedule); steps
    past it keep their last values. 0: num_steps. Set it to the original num_steps to extend a run
    (a restart with a larger num_steps) without reshaping the schedule its steps so far followed."""

    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    """Optimizer."""

    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    """Policy-gradient loss."""

    sft: SFTConfig = msgspec.field(default_factory=SFTConfig)
    """Supervised warm-up."""

    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    """Checkpointing."""

    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    """Data, expert and context parallelism."""

    fp8: Fp8Config = msgspec.field(default_factory=Fp8Config)
    """FP8 block-scaled training (rl-train --fp8)."""

    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none; full (every block); selective (keep matmul and
    attention outputs, recompute norms and activations)."""

    compile: bool = False
    """torch.compile each decoder block (rl-train --compile): fused norms, rotary and
    activations; the first steps of each new shape pay the compile time."""

    attention: Literal["auto", "varlen", "cudnn", "flex", "sdpa"] = "auto"
    """Attention kernel for packed rows (rlcli.ops.document_attention): auto (on CUDA cudnn when every
    row is one document, flex under --cp, varlen flash otherwise; sdpa on CPU); cudnn (SDPA's cuDNN
    kernel per document, flash where it does not apply); varlen; flex; sdpa (per-document SDPA)."""

    logprob_chunk_tokens: int = 1024
    """Tokens per chunk when computing logprobs/entropy from hidden states (the full-vocab
    logits of one chunk are the largest tensor; backward recomputes them chunk by chunk)."""

    logprob_keep_logits: bool = False
    """Keep forward's logits (tokens x vocab in the compute dtype) for backward instead of
    recomputing them chunk by chunk: one LM-head matmul less per chunk, for that memory."""

    num_threads: int = 0
    """threads = "fixed": torch intra-op threads (0 keeps torch's default); "adaptive": the most
    this process takes (0: every core of the host)."""

    threads: Literal["fixed", "adaptive"] = "adaptive"
    """fixed: num_threads throughout; adaptive (CPU): this process's share of the host's cores among
    the run's processes computing right now (rl-infer, other ranks), re-read between layers."""

    host: str = "127.0.0.1"
    """Interface the weights-published announcement socket binds to; 0.0.0.0 (every interface)
    lets an rl-sync on another host subscribe, and peers are told this host's address."""

    pub_port: int = 0
    """TCP port of the weights-published announcement socket; 0 picks a free one."""

    wait_timeout_s: float = 0.0
    """Give up if no rollout batch arrives for this long; 0 waits forever."""

    profile_step: int = 0
    """Run this RL step under torch.profiler (0: none): a Chrome trace per rank under
    RUN/profiles/ and the step's collective time by kind in its metrics (rlcli.train.profile)."""

    def __post_init__(self) -> None:
        if self.profile_step < 0:
            raise ValueError(f"train.profile_step must be >= 0 (0: no profiled step), got {self.profile_step}")
        if self.schedule_steps < 0:
            raise ValueError(f"train.schedule_steps must be >= 0 (0: num_steps), got {self.schedule_steps}")
        if not 0 <= self.num_threads <= 65536:
            raise ValueError(f"train.num_threads (--threads) must be in [0, 65536] (0: torch's default, or every "
                             f"core with threads = adaptive), got {self.num_threads}")
        if self.logprob_chunk_tokens < 1:
            raise ValueError(f"train.logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens}")
        if not 0 <= self.pub_port < 65536:
            raise ValueError(f"train.pub_port must be in [0, 65535], got {self.pub_port}")
        if not self.wait_timeout_s >= 0:
            raise ValueError(f"train.wait_timeout_s must be >= 0 (0 waits forever), got {self.wait_timeout_s}")
