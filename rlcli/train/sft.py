"""Supervised fine-tuning on demonstrations: the warm-up phase before RL, and `rl-train sft`.

Demonstrations come from the recipe's environment (``train.sft.dataset = "env"``: a task's
prompt and its reference answer) or from a JSONL file of ``{"prompt", "completion"}``
objects. Loss is cross-entropy on completion tokens (the EOS included), averaged over
the completion tokens of the batch.

A model in bf16 is stepped through fp32 master copies of its parameters (bf16 gradients cast
up, clipped and stepped in fp32, the result rounded back into the model): AdamW steps on bf16
parameters would round away every update below their spacing.
"""

import random
import time
from pathlib import Path
from typing import Iterator

import torch

from rlcli.config import RecipeConfig
from rlcli.envs import Task, make_env, render_prompt
from rlcli.errors import ConfigError
from rlcli.ops.attention import ForwardContext, PackedCausalAttention
from rlcli.protocol.batch import pack_rows
from rlcli.transport.jsonl import json_objects


def demonstrations(cfg: RecipeConfig, tokenizer, seed: int) -> Iterator[tuple[list[int], list[int]]]:
    """Endless (prompt ids, completion ids) pairs; completions end with EOS."""
    eos = tokenizer.eos_token_ids[:1]
    rng = random.Random(seed)
    if cfg.train.sft.dataset == "env":
        env = make_env(cfg.env)
        if not callable(getattr(env, "demonstration", None)):
            raise ConfigError(f"env {cfg.env.name} has no demonstration(task) to warm up on; set train.sft.dataset to "
                              "a JSONL file or train.sft.num_steps = 0")
        while True:
            task = env.sample_task(rng)
            yield render_prompt(task, tokenizer, cfg.env), tokenizer.encode(env.demonstration(task),
                                                                            add_special_tokens=False) + eos
    path = Path(cfg.train.sft.dataset)
    if not path.is_file():
        raise ConfigError(f"train.sft.dataset {path} not found; give a JSONL file or 'env'")
    rows = []
    lines = path.read_text(errors="surrogateescape").splitlines()  # bytes that are not UTF-8: named, not replaced
    for number, row in json_objects(lines, f"train.sft.dataset {path},"):
        if not (isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str)):
            raise ConfigError(f"train.sft.dataset {path}, line {number}: needs 'prompt' and 'completion' strings")
        rows.append(row)
    if not rows:
        raise ConfigError(f"train.sft.dataset {path} has no examples")
    while True:
        rng.shuffle(rows)
        for r in rows:
            prompt = render_prompt(Task(prompt=r["prompt"]), tokenizer, cfg.env)
            yield prompt, tokenizer.encode(r["completion"], add_special_tokens=False) + eos


def sft_loss(model, examples: list[tuple[list[int], list[int]]], capacity: int,
             device: torch.device) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over completion tokens of packed ``examples`` (backward included)."""
    lengths = [len(p) + len(c) for p, c in examples]
    total_loss, num_tokens = torch.zeros((), device=device), sum(len(c) for _, c in examples)
    for row in pack_rows(lengths, capacity):
        ids, pos, mask = [], [], []
        for i in row:
            p, c = examples[i]
            ids += p + c
            pos += list(range(len(p) + len(c)))
            mask += [False] * len(p) + [True] * len(c)
        ids_t = torch.tensor([ids], device=device)
        pos_t = torch.tensor([pos], device=device)
        logits = model(ids_t, pos_t, ForwardContext(attn=PackedCausalAttention(pos_t)))
        logp = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids_t[0, 1:, None])[:, 0]
        m = torch.tensor(mask[1:], device=device)
        loss = -(logp * m).sum() / num_tokens
        loss.backward()
        total_loss += loss.detach()
    return total_loss, num_tokens


def run_sft(cfg: RecipeConfig, model, tokenizer, log, on_step=None) -> None:
    """``cfg.train.sft.num_steps`` AdamW steps on demonstrations."""
    sft = cfg.train.sft
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    narrow = any(p.dtype != torch.float32 for p in params)
    masters = [p.detach().to(torch.float32, copy=True) for p in params] if narrow else params
    opt = torch.optim.AdamW(masters, lr=sft.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, sft.warmup_steps)))
    data = demonstrations(cfg, tokenizer, cfg.seed + 1)
    model.train()
    t0 = time.monotonic()
    for step in range(1, sft.num_steps + 1):
        examples = [next(data) for _ in range(sft.batch_size)]
        loss, _ = sft_loss(model, examples, cfg.train.micro_batch_tokens, device)
        if narrow:
            for p, m in zip(params, masters):
                m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if narrow:
            with torch.no_grad():  # in place: the weights' version moves (FP8 weight caches key on it)
                torch._foreach_copy_(params, masters)
        if step % 50 == 0 or step == sft.num_steps:
            log.info("sft step %d/%d loss %.4f (%.1fs)", step, sft.num_steps, loss.item(), time.monotonic() - t0)
        if on_step is not None:
            on_step(step, loss)
