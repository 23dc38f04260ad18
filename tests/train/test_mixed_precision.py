"""A trainer of one rank in bf16 keeps fp32 master weights (FSDP2 over a mesh of itself,
rlcli.parallel.dims), and so does the SFT warm-up: AdamW steps on bf16 parameters round away
every update below their spacing, which at RL learning rates is nearly all of them."""

import logging
import math

import pytest
import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from procs import write_recipe
from rlcli.config import load_recipe
from rlcli.envs import Task
from rlcli.models import ModelArgs, load_model
from rlcli.models.tokenizer import load_tokenizer
from rlcli.orchestrate.rollouts import Group, write_batch
from rlcli.protocol import Completion
from rlcli.train.checkpoint import save_checkpoint
from rlcli.train.sft import run_sft
from rlcli.train.trainer import Trainer, make_adamw
from rlcli.transport.rundir import RunDir

pytestmark = pytest.mark.timeout(300)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, a copy on the CPU (where the tests' references are)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def groups(n: int, vocab: int) -> list[Group]:
    """Groups whose inference logprobs are a random model's (-ln V): no token masked."""
    out = []
    for i in range(n):
        g = Group(Task(f"t{i}"), [5, 6, 7, 8 + i], 0)
        g.completions = [Completion(token_ids=[9 + j, 10, 11], logprobs=[-math.log(vocab)] * 3, versions=[0] * 3,
                                    finish_reason="length") for j in range(2)]
        g.rewards, g.advantages = [0.0, 1.0], [-0.5, 0.5]
        out.append(g)
    return out


def test_a_one_rank_bf16_trainer_steps_fp32_masters_and_resumes_them(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 1},
                                   model={"dtype": "bfloat16"}, train={"optim": {"lr": 1e-6}}))
    run = RunDir(run_dir)
    run.claim("e2e", {})
    trainer = Trainer(cfg, run)
    try:
        # one rank holding fp32 masters as DTensors: checkpoints are written behind the step all the same
        assert trainer.dims.fsdp and not trainer.dims.enabled and trainer.checkpointer is not None
        weight = trainer.model.model.layers[0].self_attn.q_proj.weight
        assert weight.dtype == torch.float32
        before = full(weight)
        write_batch(run, 1, groups(4, ModelArgs.from_dir(tiny_model_dir).vocab_size), 1, 256, 1.0)
        assert trainer.train() == 0
        after = full(trainer.model.model.layers[0].self_attn.q_proj.weight)
        # Adam's first step moves every weight with a gradient by lr: 1e-6, far below bf16's spacing
        # near 0.02 (1.2e-4), so the same update added to bf16 parameters rounds away almost everywhere.
        assert (after != before).float().mean() > 0.99
        assert (after - before).abs().max() < 2e-6
        as_bf16 = before.bfloat16()
        kept = ((as_bf16.float() + (after - before)).bfloat16() == as_bf16).float().mean().item()
        assert kept > 0.95, kept  # 0.979 here
    finally:
        trainer.close()  # the weights (async_filesystem) and the checkpoint, written behind the step, are flushed
    with safe_open(str(run.weights_dir(1) / "model.safetensors"), "pt") as f:  # engines load bf16
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    again = Trainer(cfg, run)  # its checkpoint (the last step's) holds the masters, not their bf16 rounding
    try:
        assert again.step == 1
        assert torch.equal(full(again.model.model.layers[0].self_attn.q_proj.weight), after)
    finally:
        again.close()


def test_sft_in_bf16_accumulates_updates_below_the_spacing(tmp_path, tiny_model_dir):
    """150 steps at lr 1e-6: each update alone rounds away in bf16, their sum does not."""
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run",
                                   train={"sft": {"num_steps": 150, "batch_size": 4, "lr": 1e-6}}))
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = load_model(tiny_model_dir, dtype=dtype, seed=0)
        w0 = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
        run_sft(cfg, model, load_tokenizer(tiny_model_dir), logging.getLogger("test"))
        w = model.model.layers[0].self_attn.q_proj.weight
        assert w.dtype == dtype
        moved[dtype] = (w.detach().float() - w0.float()).abs().mean().item()
    assert moved[torch.bfloat16] > 0.5 * moved[torch.float32], moved


def test_a_checkpoint_of_bf16_parameters_resumes_into_fp32_masters(tmp_path, tiny_model_dir):
    """What a one-rank bf16 trainer wrote before it kept masters (a plain bf16 model, AdamW over it)
    resumes: step, weights and Adam moments, upcast into the fp32 DTensors."""
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, tmp_path / "run", model={"dtype": "bfloat16"}))
    run = RunDir(tmp_path / "run")
    run.claim("e2e", {})
    Trainer(cfg, run).close()  # policy 0
    old = load_model(tiny_model_dir, dtype=torch.bfloat16, seed=1)
    opt = make_adamw(old.parameters(), cfg.train.optim)
    for p in old.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    save_checkpoint(run, 3, old, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), {"step": 3}, 2)
    trainer = Trainer(cfg, run)
    try:
        assert trainer.step == 3
        new, was = trainer.model.model.layers[0].self_attn.q_proj.weight, old.model.layers[0].self_attn.q_proj.weight
        assert new.dtype == torch.float32 and torch.equal(full(new), was.float())
        moments = trainer.optimizer.state[new]
        assert torch.equal(full(moments["exp_avg"]), opt.state[was]["exp_avg"].float())
    finally:
        trainer.close()


def test_a_trainer_that_fails_to_start_gives_its_one_rank_group_back(tmp_path, tiny_model_dir):
    """A config error found after the one-rank group exists: the group (and the trainer's sockets) go
    with the error, so the next trainer in the process starts on a group of its own."""
    import torch.distributed as dist

    from rlcli.errors import ConfigError

    run_dir = tmp_path / "run"
    bad = load_recipe(write_recipe(tmp_path / "bad.toml", tiny_model_dir, run_dir, top={"num_steps": 1, "r3": True},
                                   model={"dtype": "bfloat16"}))
    run = RunDir(run_dir)
    run.claim("e2e", {})
    with pytest.raises(ConfigError, match="is dense: set r3 = false"):
        Trainer(bad, run)
    assert not dist.is_initialized()
    good = Trainer(load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, top={"num_steps": 1},
                                            model={"dtype": "bfloat16"})), run)
    try:
        assert good.dims.fsdp and dist.is_initialized()
    finally:
        good.close()
    assert not dist.is_initialized()
