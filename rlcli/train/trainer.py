"""The RL training loop.

Step N reads RUN/rollouts/step_N (written by rl-orchestrate from policies >= N - 1 -
max_async), takes one optimizer step, writes RUN/weights/step_N and announces it.
Policy version N is the weights after step N; version 0 is the starting policy (the
base model, or the SFT warm-up's result), written before step 1.

The step reads top to bottom: ``train_step`` = ``forward_backward`` per packed
micro-batch, then clip, step, schedule. Token counts come from the batch file (host
side), so the loss normalizer needs no device sync; ``.item()`` happens only when
metrics are logged.
"""

import os
import threading
import time

import torch

from rlcli.config import RecipeConfig
from rlcli.errors import ConfigError
from rlcli.logging import setup_logging
from rlcli.models import DTYPES, load_model, save_model
from rlcli.models.hf_io import has_weights
from rlcli.models.tokenizer import load_tokenizer
from rlcli.ops.attention import ForwardContext, PackedCausalAttention, RoutingContext
from rlcli.process import stop_on_signals
from rlcli.protocol import WeightsPublished
from rlcli.protocol.batch import TrainingBatch
from rlcli.train.checkpoint import load_latest_checkpoint, save_checkpoint
from rlcli.train.data import to_tensors, wait_for_batch
from rlcli.train.loss import LOSSES, token_logprobs
from rlcli.train.publish import make_publisher
from rlcli.train.sft import run_sft
from rlcli.transport.atomic import atomic_dir, clean_temporaries, is_stable
from rlcli.transport.registry import Registration
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import Publisher

log = setup_logging("rl-train")


class Trainer:
    def __init__(self, cfg: RecipeConfig, run: RunDir):
        self.cfg, self.run = cfg, run
        tcfg = cfg.train
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size != 1 or cfg.orchestrate.num_train_ranks != 1:
            # Rollout files are already split per rank; sharded training (FSDP2) is what is missing.
            raise ConfigError(f"rl-train runs as one process for now (WORLD_SIZE={world_size}, "
                              f"orchestrate.num_train_ranks={cfg.orchestrate.num_train_ranks}); set both to 1")
        if tcfg.num_threads:
            torch.set_num_threads(tcfg.num_threads)
        torch.manual_seed(cfg.seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = DTYPES[cfg.model.dtype]
        self.stopping = False
        self.publisher = Publisher(cfg.infer.host, tcfg.pub_port)
        self._pub_lock = threading.Lock()  # announcements also come from the weight publisher's thread
        self.registration = Registration(run.registry_dir(), "train", 0, {"pub": self.publisher.endpoint})
        clean_temporaries(run.root / "weights")
        self.weights = make_publisher(cfg, run.root, self.announce, self.device)
        self.model = self._initial_model()
        o = tcfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
        self.step = 0
        extra = load_latest_checkpoint(run, self.model, self.optimizer, self.scheduler)
        if extra is not None:
            self.step = int(extra["step"])
            log.info("resumed from checkpoint step %d", self.step)
        self.loss_fn = LOSSES[tcfg.loss.kind]

    # ------------------------------------------------------------------ policy version 0
    def _initial_model(self):
        cfg, run = self.cfg, self.run
        if is_stable(run.weights_dir(0)):
            # Policy 0 exists (a restart): train from it; a checkpoint, if any, overrides it below.
            return load_model(run.resolve_weights(0), self.device, self.dtype, cfg.seed, fp8=cfg.train.fp8)
        # FP8 linears on master weights (train.fp8): swapped in here, before any parallelization.
        model = load_model(cfg.model.path, self.device, self.dtype, cfg.seed, fp8=cfg.train.fp8)
        if cfg.train.sft.num_steps:
            log.info("SFT warm-up: %d steps", cfg.train.sft.num_steps)
            run_sft(cfg, model, load_tokenizer(cfg.model.path), log,
                    on_step=lambda s, loss: run.append_metrics("sft", {"step": s, "loss": loss.item()})
                    if s % 10 == 0 or s == cfg.train.sft.num_steps else None)
            self.publish(0, model)
        elif has_weights(cfg.model.path):
            # The unmodified base model: a marker pointing at it instead of a copy.
            with atomic_dir(run.weights_dir(0), {"step": 0, "source": str(cfg.model.path)}):
                pass
            self.announce(0)
        else:
            self.publish(0, model)
        return model

    def publish(self, step: int, model=None) -> None:
        """Hand policy ``step`` to the weight publisher (``sync.backend``); it announces it. FP8
        publishing (weights + scales) keeps its own filesystem writer for now."""
        model = model if model is not None else self.model
        if self.cfg.train.fp8.enabled and self.cfg.train.fp8.publish:
            with atomic_dir(self.run.weights_dir(step), {"step": step}) as tmp:
                save_model(model, tmp, source_dir=self.cfg.model.path, fp8=True)
            return self.announce(step)
        self.weights.publish(step, model)

    def announce(self, step: int, path: str | None = None, timing: dict | None = None) -> None:
        msg = WeightsPublished(step=step, path=str(self.run.weights_dir(step)) if path is None else path,
                               timing=timing or {})
        with self._pub_lock:
            self.publisher.publish(msg)

    # ------------------------------------------------------------------ one step
    def forward_backward(self, mb, num_loss_tokens: int) -> dict[str, torch.Tensor]:
        t = to_tensors(mb, self.device)
        routing = RoutingContext(replay=t["routed_experts"]) if "routed_experts" in t else None
        ctx = ForwardContext(attn=PackedCausalAttention(t["position_ids"]), routing=routing)
        logits = self.model(t["input_ids"], t["position_ids"], ctx)
        lp, entropy = token_logprobs(logits, t["input_ids"], mb.temperature)
        mask = t["loss_mask"]
        lcfg = self.cfg.train.loss
        loss, metrics = self.loss_fn(lp, t["inference_logprobs"], t["advantages"], mask, lcfg)
        entropy_sum = (entropy * mask).sum()
        total = loss - lcfg.entropy_coef * entropy_sum if lcfg.entropy_coef else loss
        (total / num_loss_tokens).backward()
        metrics["loss"] = loss.detach()
        metrics["entropy"] = entropy_sum.detach()
        return metrics

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        self.model.train()
        totals: dict[str, torch.Tensor] = {}
        for mb in batch.micro_batches:
            for k, v in self.forward_backward(mb, batch.num_loss_tokens).items():
                totals[k] = totals.get(k, 0) + v
        max_norm = self.cfg.train.optim.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        n = max(batch.num_loss_tokens, 1)
        out = {k: float(v) / n for k, v in totals.items()}  # the one host sync of the step
        out["masked_fraction"] = out.pop("masked_tokens")
        out["grad_norm"] = float(grad_norm)
        out["lr"] = self.scheduler.get_last_lr()[0]
        return out

    # ------------------------------------------------------------------ loop
    def train(self) -> int:
        cfg, run = self.cfg, self.run
        if self.step >= cfg.num_steps:
            log.info("already trained %d steps", self.step)
        while self.step < cfg.num_steps and not self.stopping:
            step = self.step + 1
            t_wait = time.monotonic()
            self.registration.update(step=self.step, waiting_for=step)
            batch = wait_for_batch(run, step, 0, cfg.train.wait_timeout_s, should_stop=lambda: self.stopping)
            if batch is None:
                if self.stopping:
                    break
                log.error("no rollout batch for step %d within %.0fs (is rl-orchestrate running?)", step,
                          cfg.train.wait_timeout_s)
                return 1
            wait_s = time.monotonic() - t_wait
            t0 = time.monotonic()
            metrics = self.train_step(batch)
            compute_s = time.monotonic() - t0
            self.step = step
            t1 = time.monotonic()
            self.publish(step)
            if step % cfg.train.checkpoint.interval == 0 or step == cfg.num_steps:
                save_checkpoint(run, step, self.model, self.optimizer, self.scheduler, {"step": step},
                                cfg.train.checkpoint.keep)
            save_s = time.monotonic() - t1
            record = {"step": step, **metrics, "wait_s": wait_s, "compute_s": compute_s, "save_s": save_s,
                      "num_loss_tokens": batch.num_loss_tokens, "num_samples": batch.num_samples,
                      "min_version": batch.min_version, "max_version": batch.max_version,
                      "off_policy_lag": step - 1 - batch.min_version, "time": time.time()}
            run.append_metrics("train", record)
            run.write_progress("train", step=step)
            log.info("step %d loss %+.4f kl %.2e masked %.3f |g| %.3f lag %d (wait %.2fs, train %.2fs, save %.2fs)",
                     step, metrics["loss"], metrics["mismatch_kl"], metrics["masked_fraction"],
                     metrics["grad_norm"], record["off_policy_lag"], wait_s, compute_s, save_s)
        return 0

    def close(self) -> None:
        try:
            self.weights.close()  # an in-flight write finishes (and its error surfaces) before exit
        finally:
            self.registration.close()
            self.publisher.close()


def run(cfg: RecipeConfig, rundir: RunDir) -> int:
    trainer = Trainer(cfg, rundir)
    stop_on_signals(lambda: setattr(trainer, "stopping", True))
    try:
        return trainer.train()
    finally:
        trainer.close()
