"""The RL training loop.

Step N reads RUN/rollouts/step_N (written by rl-orchestrate from policies >= N - 1 -
max_async; its ``BatchWritten`` wakes the wait, the STABLE marker is the truth), takes one
optimizer step, writes RUN/weights/step_N and announces it, and checkpoints (behind the
step: ``rlcli.train.async_checkpoint``).
Policy version N is the weights after step N; version 0 is the starting policy (the
base model, or the SFT warm-up's result), written before step 1.

Under torchrun every rank runs this loop: the model is built on the meta device,
parallelized (``rlcli.parallel``: FSDP2 over dp x cp, EP, CP, activation checkpointing),
and each rank loads its own slices of policy 0. A trainer of one rank in bf16 is FSDP2 over
itself, for its fp32 master weights; in fp32 it holds a plain model. Data-parallel rank d reads
``rollouts/step_N/<d>.msgpack`` (the CP ranks of one dp group read the same file).
Weights and checkpoints are written by every rank into one directory that rank 0 marks
STABLE after a barrier; only rank 0 announces, registers and writes metrics.

The step reads top to bottom: ``train_step`` = ``forward_backward`` per packed
micro-batch (:mod:`rlcli.train.step`), then clip, step, schedule. The loss normalizer
(loss tokens of the whole step) is all-reduced on device; the metrics' ``.tolist()`` is
the one host sync of a step.
"""

import math
import threading
import time
from pathlib import Path

import msgspec
import torch

from rlcli.config import RecipeConfig
from rlcli.config.recipe import shared_settings
from rlcli.config.train import LossConfig, OptimConfig
from rlcli.errors import ConfigError
from rlcli.logging import setup_logging
from rlcli.models import DTYPES, ModelArgs, build_model, load_model
from rlcli.ops.batch_invariant import batch_invariant_setup, make_batch_invariant
from rlcli.models.hf_io import has_weights, save_model
from rlcli.models.tokenizer import load_tokenizer
from rlcli.parallel import parallelize, resolve_dims
from rlcli.parallel import dist as pdist
from rlcli.parallel.fsdp import clip_grad_norm_
from rlcli.parallel.loading import load_sharded
from rlcli.process import stop_on_signals
from rlcli.protocol import WeightsPublished
from rlcli.protocol.batch import TrainingBatch
from rlcli.train.async_checkpoint import AsyncCheckpointer
from rlcli.train.checkpoint import load_latest_checkpoint, save_checkpoint
from rlcli.train.data import BatchCorrupt, wait_for_batch
from rlcli.train.loss import resolve_loss
from rlcli.train.profile import compile_counts, peak_gib, reduce_max, reset_peak, step_profile
from rlcli.train.publish import make_publisher
from rlcli.train.sft import run_sft
from rlcli.train.step import accumulate
from rlcli.transport.atomic import atomic_dir, clean_temporaries, is_stable, remove_dir, verify_files
from rlcli.transport.cores import CoreShare, hook_layers
from rlcli.transport.host_memory import keep_freed_memory
from rlcli.transport.registry import Registration, list_entries
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import Publisher, Subscriber

log = setup_logging("rl-train")


def step_metrics(totals: dict[str, float], num_loss_tokens: float) -> dict[str, float]:
    """Per-step means from the summed loss diagnostics (names as in prime-rl where it has them)."""
    n = max(num_loss_tokens, 1)
    out = {
        "loss": totals["loss"] / n, "entropy": totals["entropy"] / n, "ratio": totals["ratio"] / n,
        "mismatch_kl": totals["mismatch_kl"] / n,
        "mismatch_kl_kept": totals["mismatch_kl_kept"] / max(totals["kept_tokens"], 1),
        "masked_fraction": totals["masked_tokens"] / n,
        "masked_low_fraction": totals["masked_low"] / n, "masked_high_fraction": totals["masked_high"] / n,
        "masked_by_sequence_fraction": totals["masked_by_sequence"] / n,
        "logprob_diff_abs_mean": totals["logprob_diff_abs"] / n,
        "logprob_diff_abs_max": totals["logprob_diff_abs_max"],
    }
    if "kl_penalty" in totals:  # train.loss.kl_tau: the mean squared log ratio it penalizes
        out["kl_penalty"] = totals["kl_penalty"] / n
    if "router_pairs" in totals:
        out["router_disagreement"] = totals["router_disagree"] / max(totals["router_pairs"], 1)
    return out


def make_adamw(params, o: OptimConfig) -> torch.optim.AdamW:
    """AdamW of train.optim. ``implementation`` auto is the fused kernel: one pass over each
    parameter instead of a dozen elementwise ops, on CUDA and on a CPU, plain or sharded
    (DTensor) parameters alike, on one mesh or several (experts over their own): on a CPU
    ~5x less optimizer time than torch's default, for SmolLM2-135M and for two gloo ranks."""
    extra = {"fused": True} if o.implementation in ("auto", "fused") else {"foreach": True}
    return torch.optim.AdamW(list(params), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             weight_decay=o.weight_decay, **extra)


def lr_factor(step: int, optim: OptimConfig, num_steps: int) -> float:
    """Multiplier of ``optim.lr`` for optimizer step ``step`` (0-based): a linear warm-up, then
    constant or a linear/cosine decay that reaches ``min_lr_ratio`` at step ``num_steps``."""
    warm = min(1.0, (step + 1) / optim.warmup_steps) if optim.warmup_steps else 1.0
    if optim.schedule == "constant":
        return warm
    done = min(1.0, max(0, step + 1 - optim.warmup_steps) / max(1, num_steps - optim.warmup_steps))
    decay = 1 - done if optim.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * done))
    return warm * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * decay)


def schedule_horizon(cfg: RecipeConfig) -> int:
    """The RL step where the learning-rate and entropy schedules end: ``train.schedule_steps``,
    else ``num_steps``."""
    return cfg.train.schedule_steps or cfg.num_steps


def loss_config_at(lcfg: LossConfig, step: int, num_steps: int) -> LossConfig:
    """The loss settings of RL step ``step`` (1-based): ``entropy_schedule = "linear"`` scales the
    entropy bonus from ``entropy_coef`` at step 1 down to 0 at step ``num_steps``."""
    if lcfg.entropy_schedule == "constant" or not lcfg.entropy_coef:
        return lcfg
    left = max(0.0, 1 - (step - 1) / max(1, num_steps - 1))
    return msgspec.structs.replace(lcfg, entropy_coef=lcfg.entropy_coef * left)


WAIT_NOTE_S = 30.0
"""A wait for a step's batch longer than this is said (:class:`WaitNote`); rl-train is otherwise silent while it waits."""


class WaitNote:
    """What rl-train waits for, said after ``after_s`` of waiting for a step's batch: once per step
    while no rl-orchestrate is registered; while one is (it is generating), once per process, since
    long steps are then normal."""

    def __init__(self, after_s: float):
        self.after_s = after_s
        self.step, self.since, self.said, self.said_live = -1, 0.0, True, False

    def start(self, step: int) -> None:
        if step != self.step:
            self.step, self.since, self.said = step, time.monotonic(), False

    def due(self, now: float, orchestrator_live: bool, batch_dir: Path) -> str:
        """The line to log now, or ""."""
        if self.said or now - self.since < self.after_s or (orchestrator_live and self.said_live):
            return ""
        self.said = True
        self.said_live |= orchestrator_live
        why = ("rl-orchestrate is registered but has not written it (said once)" if orchestrator_live
               else "no rl-orchestrate is registered in this run (start `rl-orchestrate run` on the same recipe)")
        return f"waiting {now - self.since:.0f}s for step {self.step}'s batch ({batch_dir}): {why}"


class Trainer:
    def __init__(self, cfg: RecipeConfig, run: RunDir):
        self.cfg, self.run = cfg, run
        self.batch_news = self.weights = self.checkpointer = self.registration = self.publisher = self.cores = None
        try:
            self._start()
        except BaseException:
            self.close()  # sockets, CPU share, the one-rank group: a caller that goes on gets them back
            raise

    def _start(self) -> None:
        cfg, run, tcfg = self.cfg, self.run, self.cfg.train
        if tcfg.num_threads and tcfg.threads == "fixed":
            torch.set_num_threads(tcfg.num_threads)
        torch.manual_seed(cfg.seed)
        self.dtype = DTYPES[cfg.model.dtype]
        # In bf16 the trainer shards even when alone, over a mesh of itself: fp32 masters (rlcli.parallel.dims).
        mixed_precision = self.dtype != torch.float32
        self.dist = pdist.init_distributed(one_rank_group=mixed_precision)
        self.device = self.dist.device
        if self.device.type == "cpu":  # a step's large temporaries reuse the last step's pages
            keep_freed_memory()
        # Adaptive threads on a CPU: a share of the cores by who computes (rlcli.transport.cores).
        if tcfg.threads == "adaptive" and self.device.type == "cpu" and not cfg.model.batch_invariant:
            self.cores = CoreShare(run.root, "train", self.dist.rank, tcfg.num_threads)
        self.args = ModelArgs.from_dir(cfg.model.path)
        if cfg.r3 and not self.args.is_moe:
            raise ConfigError(f"r3 = true needs a mixture-of-experts model; {cfg.model.path} is dense: set r3 = false")
        self.dims = resolve_dims(tcfg.parallel, self.dist.world_size, self.args.num_experts,
                                 cfg.orchestrate.num_train_ranks, tcfg.micro_batch_tokens)
        self.dims.fsdp_one_rank = mixed_precision and not self.dims.enabled
        self.dims.build(self.device.type)
        self.dp_rank, self.cp_rank = self.dims.coords(self.dist.rank)
        if self.device.type == "cuda" and self.dtype == torch.float32 and self.dist.is_main:
            # The recipe default, right on a CPU; on a GPU FlexAttention's fp32 kernels (--cp) and the
            # experts' per-expert fp32 loop (no fp32 grouped GEMM there) are many times slower than bf16.
            log.warning("model.dtype = float32 on CUDA: the trainer computes in fp32; set model.dtype = "
                        "\"bfloat16\" to compute in bf16")
        self.stopping = False
        self.busy_s = 600.0  # the promised bound on one step (train + publish + checkpoint); measured after one
        main = self.dist.is_main
        self.publisher = Publisher(tcfg.host, tcfg.pub_port) if main else None
        self._pub_lock = threading.Lock()  # announcements also come from the weight publisher's thread
        self.batch_news = Subscriber()  # rl-orchestrate's BatchWritten: wakes the wait for a batch
        self._next_scan = 0.0
        self._wait_note = WaitNote(WAIT_NOTE_S)
        self.registration = Registration(run.registry_dir(), "train", 0, {"pub": self.publisher.endpoint},
                                         {"dp": self.dims.dp, "settings": shared_settings(cfg, "train")}) \
            if main else None  # rl-orchestrate splits batches for dp
        self.beat(busy_s=self.busy_s)  # building, warm-up, loading the checkpoint: the loop starts after
        if main:
            self.registration.take_long_op_notices()  # a kernel's first-use compile inside a step (fp8 backends)
            clean_temporaries(run.root / "weights")
        self.weights = make_publisher(cfg, run.root, self.announce, self.device)  # every rank: sync.backend
        self.model = self._build_model(self._policy_zero())
        if self.cores is not None:
            if not getattr(tcfg, "compile", False):  # hooks inside compiled blocks would break their graphs
                hook_layers(self.cores, self.model.model.layers)
            self.cores.busy(False)  # until a batch arrives (the SFT warm-up was busy)
        o = tcfg.optim
        self.optimizer = make_adamw(self.model.parameters(), o)
        horizon = schedule_horizon(cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, o, horizon))
        self.step = 0
        extra = load_latest_checkpoint(run, self.model, self.optimizer, self.scheduler)
        if extra is not None:
            self.step = int(extra["step"])
            saved = extra.get("parallel")
            if saved and saved != self._mesh_record():
                log.info("checkpoint written with %s; resharded to %s", saved, self._mesh_record())
            log.info("resumed from checkpoint step %d", self.step)
        self.loss_fn = resolve_loss(tcfg.loss.kind)
        # Checkpoints behind the step (rlcli.train.async_checkpoint), the writers' collectives on a group of their own.
        self.checkpointer = AsyncCheckpointer(run, tcfg.checkpoint.keep, self._mesh_record(), pdist.new_cpu_group(),
                                              tcfg.checkpoint.keep_every) \
            if tcfg.checkpoint.background else None

    def _mesh_record(self) -> dict:
        return {"dp": self.dims.dp, "cp": self.dims.cp, "ep": self.dims.ep}

    # ------------------------------------------------------------------ policy version 0
    def beat(self, busy_s: float = 0.0) -> None:
        if self.registration is not None:
            self.registration.beat(busy_s)

    def _policy_zero(self):
        """Directory of policy 0, written by rank 0 if it does not exist yet (SFT warm-up, or
        random weights for a config-only model); every rank then loads its shards from it.

        A restart that finds a checkpoint needs policy 0 only for its shapes (the checkpoint
        overwrites every value), so once rl-sync has pruned weights/step_0 it starts from the
        base model (or the newest published weights) instead of re-running the warm-up."""
        cfg, run = self.cfg, self.run
        if self.dist.is_main and is_stable(run.weights_dir(0)):
            problems = verify_files(run.weights_dir(0))
            if problems:  # written by an earlier start: write it again (or do without it, below)
                log.warning("%s is damaged (%s); writing policy 0 again", run.weights_dir(0), "; ".join(problems))
                remove_dir(run.weights_dir(0))
        pdist.barrier()
        if not is_stable(run.weights_dir(0)) and run.latest_stable("checkpoints") is not None:
            newest = run.latest_stable("weights")
            source = cfg.model.path if has_weights(cfg.model.path) or newest is None else run.resolve_weights(newest)
            source = pdist.broadcast_object(str(source))
            log.info("policy 0 was pruned; building the model from %s, then resuming the checkpoint", source)
            return source
        if not is_stable(run.weights_dir(0)) and self.dist.is_main:
            if cfg.train.sft.num_steps:
                if self.cores is not None:
                    self.cores.busy(True)
                model = load_model(cfg.model.path, self.device, self.dtype, cfg.seed, fp8=cfg.train.fp8)
                log.info("SFT warm-up: %d steps", cfg.train.sft.num_steps)

                def on_step(s: int, loss) -> None:
                    self.beat()
                    if s % 10 == 0 or s == cfg.train.sft.num_steps:
                        run.append_metrics("sft", {"step": s, "loss": loss.item()})

                run_sft(cfg, model, load_tokenizer(cfg.model.path), log, on_step=on_step)
                self._write_full(0, model)
            elif has_weights(cfg.model.path):
                # The unmodified base model: a marker pointing at it instead of a copy.
                with atomic_dir(run.weights_dir(0), {"step": 0, "source": str(cfg.model.path)}):
                    pass
            else:
                self._write_full(0, load_model(cfg.model.path, "cpu", self.dtype, cfg.seed))
            self.announce(0)
        pdist.barrier()
        return run.resolve_weights(0)

    def _write_full(self, step: int, model) -> None:
        with atomic_dir(self.run.weights_dir(step), {"step": step}) as tmp:
            save_model(model, tmp, source_dir=self.cfg.model.path)

    def _warm_up_fp8(self, model) -> None:
        """DeepGEMM's kernels for every micro-batch size, compiled before the first step by one rank per
        host (the JIT cache is a directory on the host) while the others wait (rlcli.ops.fp8.warmup)."""
        from rlcli.ops.fp8.warmup import warm_up_model
        from rlcli.parallel.context import rank_tokens

        if self.dist.local_rank == 0:  # under CP a rank's GEMMs see its share of a row
            warm_up_model(model, max_tokens=rank_tokens(self.cfg.train.micro_batch_tokens, self.dims.cp),
                          top_k=self.args.num_experts_per_tok,
                          ep=self.dims.ep, backward=True, device=self.device, ue8m0=self.cfg.train.fp8.ue8m0,
                          tokens=self.cfg.train.fp8.jit_warmup_tokens or None)
        pdist.barrier()

    def _build_model(self, weights_dir):
        """Meta device -> parallelize -> materialize -> each rank loads its own slices. Under
        FSDP2 (several ranks, or one in bf16) the parameters are fp32 master weights and compute
        runs in model.dtype."""
        master = torch.float32 if self.dims.fsdp else self.dtype
        model = build_model(self.args, device="meta", dtype=master, materialize=False)
        if self.cfg.train.fp8.enabled:  # FP8 linears on master weights, swapped in before parallelizing
            from rlcli.ops.fp8.convert import convert_to_fp8

            convert_to_fp8(model, self.cfg.train.fp8, self.device)
            if self.cfg.train.fp8.jit_warmup:
                self._warm_up_fp8(model)
        if self.cfg.model.batch_invariant:  # the engine's rounding (rlcli.ops.batch_invariant)
            batch_invariant_setup(self.device)
            make_batch_invariant(model)
        parallelize(model, self.dims, self.cfg.train, self.dtype)
        model.to_empty(device=self.device)
        if not self.dims.fsdp:
            model.tie_weights()
        model.init_buffers()
        load_sharded(model, weights_dir)
        return model

    def publish(self, step: int) -> None:
        """Hand policy ``step`` to the weight publisher (``sync.backend``: filesystem, async
        filesystem or collective; FP8 weights + scales as files; rlcli.train.publish), which
        announces it."""
        self.weights.publish(step, self.model)

    def _publish_resumed_policy(self) -> None:
        """Publish the resumed step's policy again when no weights of it (or later) are on disk.

        A step's checkpoint and its weights commit apart (``train.checkpoint.background`` and
        ``async_filesystem`` write on two threads), so a trainer killed between the two resumed
        past a policy that was never published: mid-run the servers skipped that version, and at
        the last step the run ended without its final policy. File backends only: a collective
        update's weights are the trainer's memory and are sent again from the next step."""
        from rlcli.train.publish import FilesystemPublisher

        if self.step == 0 or not isinstance(self.weights, FilesystemPublisher):
            return
        newest = self.run.latest_stable("weights") if self.dist.is_main else None
        newest = pdist.broadcast_object(newest)  # one decision: publish() is collective
        if newest is None or newest < self.step:
            log.info("policy %d was checkpointed but not published (newest weights: %s); publishing it",
                     self.step, "none" if newest is None else f"step {newest}")
            self.publish(self.step)

    def announce(self, step: int, path: str | None = None, timing: dict | None = None) -> None:
        if self.publisher is None:
            return
        msg = WeightsPublished(step=step, path=str(self.run.weights_dir(step)) if path is None else path,
                               timing=timing or {})
        with self._pub_lock:
            self.publisher.publish(msg)

    # ------------------------------------------------------------------ one step
    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        self.model.train()
        tcfg = self.cfg.train
        lcfg = loss_config_at(tcfg.loss, self.step + 1, schedule_horizon(self.cfg))
        totals, normalizer = accumulate(self.model, batch.micro_batches, self.dims, self.device, self.loss_fn,
                                        lcfg, tcfg.logprob_chunk_tokens, self.cfg.r3,
                                        "invariant" if self.cfg.model.batch_invariant else tcfg.attention,
                                        tcfg.parallel.reshard, tcfg.logprob_keep_logits)
        grad_norm = clip_grad_norm_(self.model.parameters(), tcfg.optim.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Every rank's sums are disjoint (dp: other rows; cp: other tokens of the same rows); maxima reduce by max.
        sums = sorted(k for k in totals if not k.endswith("_max"))
        maxes = sorted(k for k in totals if k.endswith("_max"))
        summed = pdist.all_reduce_sum(torch.stack([totals[k].float() for k in sums]))
        peak = pdist.all_reduce_max(torch.stack([totals[k].float() for k in maxes])) if maxes else summed[:0]
        load = self._expert_load()  # MoE: every rank's routed-token counts, summed over the world
        values = torch.cat([summed, peak, torch.stack(list(load.values())).to(summed) if load else summed[:0],
                            normalizer.reshape(1), grad_norm.reshape(1).to(summed)]).tolist()
        # ^ the one host sync of the step
        host = dict(zip(sums + maxes + list(load) + ["num_loss_tokens", "grad_norm"], values))
        tokens = {k: host.get(k, 0.0) for k in ("tokens_unique", "tokens_total")}
        return step_metrics(host, host["num_loss_tokens"]) | {k: host[k] for k in load} | tokens | {
            "grad_norm": host["grad_norm"], "lr": self.scheduler.get_last_lr()[0], "entropy_coef": lcfg.entropy_coef}

    def _expert_load(self) -> dict[str, torch.Tensor]:
        """Load-balance metrics of this step's MoE routing (empty for a dense model)."""
        if not self.model.args.is_moe:
            return {}
        from rlcli.parallel.expert import expert_load_metrics

        return expert_load_metrics(self.model, torch.distributed.group.WORLD if self.dims.enabled else None)

    # ------------------------------------------------------------------ loop
    def train(self) -> int:
        cfg, run = self.cfg, self.run
        self._publish_resumed_policy()
        if self.step >= cfg.num_steps:
            log.info("already trained %d steps", self.step)
        while self.step < cfg.num_steps and not self.stopping:
            step = self.step + 1
            t_wait = time.monotonic()
            if self.registration is not None:
                self.registration.update(step=self.step, waiting_for=step)
            batch = self.next_batch(step)
            if batch is None:
                if self.stopping:
                    break
                log.error("no rollout batch for step %d within %.0fs (is rl-orchestrate running?)", step,
                          cfg.train.wait_timeout_s)
                return 1
            wait_s = time.monotonic() - t_wait
            t0 = time.monotonic()
            self.beat(busy_s=self.busy_s)
            if self.cores is not None:
                self.cores.busy(True)
            reset_peak(self.device)
            compiled = compile_counts()
            with step_profile(run.root / "profiles", step, self.dist.rank, self.device,
                              step == cfg.train.profile_step) as profiled:
                metrics = self.train_step(batch)
            compiled = {k: v - compiled[k] for k, v in compile_counts().items()}  # this step's (re)compiles
            metrics |= reduce_max(profiled | peak_gib(self.device) | compiled, self.device)
            if self.cores is not None:
                metrics["threads"] = self.cores.threads  # the share at the end of the step
                self.cores.busy(False)
            compute_s = time.monotonic() - t0
            # Shared prompts: the rows hold fewer tokens than the samples (tokens_total); time per unique one.
            metrics["compute_us_per_unique_token"] = compute_s * 1e6 / max(metrics["tokens_unique"], 1.0)
            self.step = step
            t1 = time.monotonic()
            self.publish(step)
            publish_s = time.monotonic() - t1
            if step % cfg.train.checkpoint.interval == 0 or step == cfg.num_steps:
                self.checkpoint(step)
            save_s = time.monotonic() - t1
            self.busy_s = max(60.0, 3 * (compute_s + save_s))
            record = {"step": step, **metrics, "wait_s": wait_s, "compute_s": compute_s, "save_s": save_s,
                      "publish_s": publish_s, "checkpoint_s": save_s - publish_s,
                      "num_loss_tokens": batch.num_loss_tokens, "num_samples": batch.num_samples,
                      "min_version": batch.min_version, "max_version": batch.max_version,
                      "off_policy_lag": step - 1 - batch.min_version, "batch_checksum": self.batch_checksum,
                      "time": time.time()}
            if self.dist.is_main:
                run.append_metrics("train", record)
                run.write_progress("train", step=step)
            log.info("step %d loss %+.4f kl %.2e (kept %.2e) masked %.3f (low %.3f high %.3f) |dlp| max %.2f%s "
                     "|g| %.3f lag %d tokens %d/%d (wait %.2fs, train %.2fs, save %.2fs)",
                     step, metrics["loss"], metrics["mismatch_kl"], metrics["mismatch_kl_kept"],
                     metrics["masked_fraction"], metrics["masked_low_fraction"], metrics["masked_high_fraction"],
                     metrics["logprob_diff_abs_max"],
                     (f" router disagree {metrics['router_disagreement']:.3f}" if "router_disagreement" in metrics
                      else "") + (f" experts max/mean {metrics['moe_max_over_mean']:.2f}"
                                  if "moe_max_over_mean" in metrics else ""), metrics["grad_norm"],
                     record["off_policy_lag"], metrics["tokens_unique"], metrics["tokens_total"], wait_s, compute_s,
                     save_s)
        return 0

    def checkpoint(self, step: int) -> None:
        """Checkpoint ``step``: snapshot and write behind (``train.checkpoint.background``), or in the step."""
        state = (self.model, self.optimizer, self.scheduler, {"step": step})
        if self.checkpointer is not None:
            self.checkpointer.save(step, *state)
        else:
            c = self.cfg.train.checkpoint
            save_checkpoint(self.run, step, *state, c.keep, self._mesh_record(), c.keep_every)

    def next_batch(self, step: int) -> TrainingBatch | None:
        """This rank's batch of ``step`` (None on timeout or stop). A batch that any rank finds
        corrupt is deleted, and every rank waits for rl-orchestrate to write it again."""
        self._wait_note.start(step)
        while True:
            try:
                read = wait_for_batch(self.run, step, self.dp_rank, self.cfg.train.wait_timeout_s,
                                      should_stop=lambda: self.beat() or self.stopping, sleep=self._sleep,
                                      num_ranks=self.dims.dp)
                batch, self.batch_checksum = read if read is not None else (None, "")
                problem = ""
            except BatchCorrupt as e:
                batch, problem = None, str(e)
            if not pdist.all_reduce_max_int(int(bool(problem))):
                return batch
            if problem:
                log.error("rollout batch %d is unusable (%s); deleted it, waiting for rl-orchestrate to rewrite it",
                          step, problem)
            pdist.barrier()
            if self.dist.is_main:
                remove_dir(self.run.rollouts_dir(step))
            pdist.barrier()

    def _sleep(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a batch, woken at once by rl-orchestrate's announcement."""
        if time.monotonic() >= self._next_scan:
            producers = list_entries(self.run.registry_dir(), "orchestrate")
            for entry in producers:
                if "pub" in entry.endpoints:
                    self.batch_news.connect(entry.endpoints["pub"])
            self._next_scan = time.monotonic() + 1.0
            note = self._wait_note.due(time.monotonic(), bool(producers), self.run.rollouts_dir(self._wait_note.step))
            if note:
                log.info("%s", note)
        self.batch_news.recv(int(timeout_s * 1000))

    def close(self) -> None:
        """Release what was made, also when ``__init__`` stopped part way."""
        if self.batch_news is not None:
            self.batch_news.close()
        try:
            try:
                if self.weights is not None:
                    self.weights.close()  # an in-flight write finishes (and its error surfaces) before exit
            finally:
                if self.checkpointer is not None:
                    self.checkpointer.close()  # the pending checkpoint is committed before exit
        finally:
            if self.registration is not None:
                self.registration.close()
            if self.publisher is not None:
                self.publisher.close()
            if self.cores is not None:
                self.cores.close()
            pdist.shutdown()


def run(cfg: RecipeConfig, rundir: RunDir) -> int:
    trainer = Trainer(cfg, rundir)
    stop_on_signals(lambda: setattr(trainer, "stopping", True))
    try:
        return trainer.train()
    finally:
        trainer.close()
