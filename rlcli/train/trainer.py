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
import time

import torch

from rlcli.config import RecipeConfig
from rlcli.errors import ConfigError
from rlcli.logging import setup_logging
from rlcli.models import DTYPES, load_model, save_model
from rlcli.models.hf_io import has_weights
from rlcli.models.moe import check_routes
from rlcli.models.tokenizer import load_tokenizer
from rlcli.ops.attention import ForwardContext, PackedCausalAttention, RoutingContext
from rlcli.process import stop_on_signals
from rlcli.protocol import WeightsPublished
from rlcli.protocol.batch import TrainingBatch
from rlcli.train.checkpoint import load_latest_checkpoint, save_checkpoint
from rlcli.train.data import to_tensors, wait_for_batch
from rlcli.train.loss import LOSSES, sequence_ids, token_logprobs
from rlcli.train.sft import run_sft
from rlcli.transport.atomic import atomic_dir, clean_temporaries, is_stable
from rlcli.transport.registry import Registration
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import Publisher

log = setup_logging("rl-train")


def step_metrics(totals: dict[str, float], num_loss_tokens: int) -> dict[str, float]:
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
    if "router_pairs" in totals:
        out["router_disagreement"] = totals["router_disagree"] / max(totals["router_pairs"], 1)
    return out


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
        self.registration = Registration(run.registry_dir(), "train", 0, {"pub": self.publisher.endpoint})
        clean_temporaries(run.root / "weights")
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
        if cfg.r3 and not self.model.args.is_moe:
            raise ConfigError(f"r3 = true needs a mixture-of-experts model; {cfg.model.path} is dense: set r3 = false")

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
        """Write policy ``step`` to RUN/weights/step_<step> (STABLE last) and announce it."""
        with atomic_dir(self.run.weights_dir(step), {"step": step}) as tmp:
            save_model(model if model is not None else self.model, tmp, source_dir=self.cfg.model.path,
                       fp8=self.cfg.train.fp8.enabled and self.cfg.train.fp8.publish)
        self.announce(step)

    def announce(self, step: int) -> None:
        self.publisher.publish(WeightsPublished(step=step, path=str(self.run.weights_dir(step))))

    # ------------------------------------------------------------------ one step
    def _routing(self, t: dict[str, torch.Tensor]) -> RoutingContext | None:
        """R3: replay the engine's routes; refuse batches that disagree with this trainer's r3."""
        routes = t.get("routed_experts")
        if not self.cfg.r3:
            if routes is not None:
                raise ConfigError("the rollout batch carries MoE routes (rl-orchestrate runs with r3) but "
                                  "rl-train does not: set r3 = true for both")
            return None
        if routes is None:
            raise ConfigError("rl-train runs with r3 = true but the rollout batch has no routes: set r3 = true "
                              "for rl-orchestrate too")
        check_routes(routes, self.model.args, t["input_ids"].shape[1])
        pos = t["position_ids"][0]
        last = torch.cat([pos[1:] == 0, pos.new_ones(1, dtype=torch.bool)])  # a sequence's last token
        return RoutingContext(replay=routes, counted=~last)

    def forward_backward(self, mb, num_loss_tokens: int) -> dict[str, torch.Tensor]:
        t = to_tensors(mb, self.device)
        routing = self._routing(t)
        ctx = ForwardContext(attn=PackedCausalAttention(t["position_ids"]), routing=routing)
        logits = self.model(t["input_ids"], t["position_ids"], ctx)
        lp, entropy = token_logprobs(logits, t["input_ids"], mb.temperature, mb.top_p)
        lcfg = self.cfg.train.loss
        loss, kept, metrics = self.loss_fn(lp, t["inference_logprobs"], t["advantages"], t["loss_mask"],
                                           sequence_ids(t["position_ids"]), lcfg)
        entropy_sum = (entropy * kept).sum()  # the bonus only on tokens the loss keeps
        total = loss - lcfg.entropy_coef * entropy_sum if lcfg.entropy_coef else loss
        (total / num_loss_tokens).backward()
        metrics["loss"] = loss.detach()
        metrics["entropy"] = (entropy.detach() * t["loss_mask"]).sum()
        if routing is not None:
            metrics["router_disagree"] = torch.as_tensor(routing.num_disagree, dtype=torch.float32)
            metrics["router_pairs"] = torch.as_tensor(routing.num_pairs, dtype=torch.float32)
        return metrics

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        self.model.train()
        totals: dict[str, torch.Tensor] = {}
        for mb in batch.micro_batches:
            for k, v in self.forward_backward(mb, batch.num_loss_tokens).items():
                if k.endswith("_max"):
                    totals[k] = torch.maximum(totals[k], v) if k in totals else v
                else:
                    totals[k] = totals.get(k, 0) + v
        max_norm = self.cfg.train.optim.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return step_metrics({k: float(v) for k, v in totals.items()},  # the one host sync of the step
                            batch.num_loss_tokens) | {"grad_norm": float(grad_norm),
                                                      "lr": self.scheduler.get_last_lr()[0]}

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
            log.info("step %d loss %+.4f kl %.2e (kept %.2e) masked %.3f (low %.3f high %.3f) |dlp| max %.2f%s "
                     "|g| %.3f lag %d (wait %.2fs, train %.2fs, save %.2fs)",
                     step, metrics["loss"], metrics["mismatch_kl"], metrics["mismatch_kl_kept"],
                     metrics["masked_fraction"], metrics["masked_low_fraction"], metrics["masked_high_fraction"],
                     metrics["logprob_diff_abs_max"],
                     f" router disagree {metrics['router_disagreement']:.3f}" if "router_disagreement" in metrics
                     else "", metrics["grad_norm"], record["off_policy_lag"], wait_s, compute_s, save_s)
        return 0

    def close(self) -> None:
        self.registration.close()
        self.publisher.close()


def run(cfg: RecipeConfig, rundir: RunDir) -> int:
    trainer = Trainer(cfg, rundir)
    stop_on_signals(lambda: setattr(trainer, "stopping", True))
    try:
        return trainer.train()
    finally:
        trainer.close()
