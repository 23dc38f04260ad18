"""On-policy distillation (orchestrate.teacher) against live servers: a student rl-infer, and teachers
that are rl-infer processes of their own run directories. A teacher with the student's own weights
gives every token a term of ~0 (its scoring and the student's sampling compute the same logprobs); one
with other weights gives coef * (its logprob - the student's), checked against a direct forward of the
teacher's model; environment turns get nothing, and the terms reach the trainer's batch."""

import pytest
import torch
from procs import Procs, serve_initial_policy, wait_until, write_recipe
from test_episodes import ENV_MODULE, run_groups

from rlcli.config import load_recipe
from rlcli.models import load_model, save_model
from rlcli.orchestrate.loop import Orchestrator
from rlcli.orchestrate.rollouts import write_batch
from rlcli.protocol.batch import decode_batch
from rlcli.transport.atomic import atomic_dir
from rlcli.transport.registry import list_entries
from rlcli.transport.rundir import RunDir

pytestmark = pytest.mark.timeout(300)
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from tiny import write_tiny_model

    tmp = tmp_path_factory.mktemp("teacher")
    model_dir = write_tiny_model(tmp / "tiny")
    (tmp / "mtenv.py").write_text(ENV_MODULE)
    engine = {"name": "native", "num_threads": 1, "kv_cache_memory_mb": 16, "block_size": 4}
    procs = Procs(tmp / "logs")
    runs = {}
    for name, seed in (("student", 0), ("same", 0), ("other", 7)):
        run_dir = tmp / name
        recipe = write_recipe(tmp / f"{name}.toml", model_dir, run_dir, model={"max_seq_len": 96},
                              env={"name": "mtenv:Chat", "max_turns": 8}, infer={"engine": engine},
                              orchestrate={"batch_size": 2, "group_size": 2, "max_async": 0,
                                           "sampling": {"temperature": TEMPERATURE, "max_tokens": 8}})
        if name == "student":
            serve_initial_policy(run_dir, model_dir)
        else:  # a teacher: its own run directory and weights; model.max_seq_len above the student's episodes
            recipe = write_recipe(tmp / f"{name}.toml", model_dir, run_dir, model={"max_seq_len": 128},
                                  infer={"engine": engine})
            with atomic_dir(run_dir / "weights" / "step_0", {"step": 0}) as d:
                save_model(load_model(model_dir, seed=seed), d, source_dir=model_dir)
        procs.start(f"infer-{name}", recipe, "--id", "0")
        runs[name] = (recipe, run_dir)
    try:
        for name, (_, run_dir) in runs.items():
            wait_until(lambda: list_entries(run_dir / "registry", "infer"), 120, f"{name} rl-infer registered", procs)
        yield tmp, model_dir, runs
    finally:
        procs.stop_all()


def distill(fleet, monkeypatch, teacher: str, **teacher_table):
    tmp, _, runs = fleet
    recipe, run_dir = runs["student"]
    overrides = {"orchestrate.teacher.run_dir": str(runs[teacher][1])}
    overrides.update({f"orchestrate.teacher.{k}": v for k, v in teacher_table.items()})
    return run_groups(recipe, run_dir, monkeypatch, tmp, overrides)


def test_a_teacher_with_the_students_weights_adds_nothing(fleet, monkeypatch):
    o = distill(fleet, monkeypatch, "same")
    for g in o.buffer:
        assert len(g.token_advantages) == 2
        for terms, mask in zip(g.token_advantages, g.loss_masks):
            assert len(terms) == len(mask) and any(mask) and not all(mask)  # model and environment turns
            assert all(t == 0.0 for t, k in zip(terms, mask) if not k)
            assert max(abs(t) for t in terms) < 1e-4
    assert abs(o.teacher.metrics()["teacher_kl"]) < 1e-5 and o.teacher.metrics()["teacher_errors"] == 0


def test_another_teachers_terms_are_its_logprobs_minus_the_students(fleet, monkeypatch):
    tmp, model_dir, _ = fleet
    o = distill(fleet, monkeypatch, "other", coef=0.5, reward=False)
    teacher = load_model(model_dir, seed=7).eval()
    for g in o.buffer:
        assert g.advantages == [0.0, 0.0]  # reward = false: the teacher's term alone
        for c, terms, mask in zip(g.completions, g.token_advantages, g.loss_masks):
            ids = g.prompt_ids + c.token_ids
            with torch.no_grad():
                lp = torch.log_softmax(teacher(torch.tensor([ids]))[0].float() / TEMPERATURE, -1)
            p = len(g.prompt_ids)
            expected = [0.5 * (float(lp[p + j - 1, tok]) - s) if k else 0.0
                        for j, (tok, s, k) in enumerate(zip(c.token_ids, c.logprobs, mask))]
            assert terms == pytest.approx(expected, abs=1e-4) and max(map(abs, terms)) > 1e-2
    # The batch the trainer reads carries each token's advantage: its sequence's plus its term.
    out = RunDir(tmp / "batch")
    write_batch(out, 1, o.buffer, 1, 512, TEMPERATURE)
    batch = decode_batch((out.root / "rollouts" / "step_1" / "0.msgpack").read_bytes())
    trained = torch.cat([torch.from_numpy(mb.advantages.numpy()[mb.loss_mask.numpy()]) for mb in batch.micro_batches])
    terms = torch.tensor([t for g in o.buffer for ts, m in zip(g.token_advantages, g.loss_masks)
                          for t, k in zip(ts, m) if k])
    assert torch.allclose(trained.sort().values, terms.float().sort().values, atol=1e-6)
    assert o.teacher.metrics()["teacher_kl"] > 0


def test_an_unreachable_teacher_and_two_teachers_are_refused(fleet, monkeypatch):
    from rlcli.errors import ConfigError, PeerUnreachable

    tmp, _, runs = fleet
    monkeypatch.syspath_prepend(str(tmp))
    recipe, run_dir = runs["student"]
    cfg = load_recipe(recipe, overrides={"env.args": {}, "orchestrate.teacher.connect": ["tcp://127.0.0.1:9"],
                                         "orchestrate.request_timeout_s": 1.0})
    with pytest.raises(PeerUnreachable):
        Orchestrator(cfg, RunDir(run_dir))
    with pytest.raises(ConfigError, match="give connect or run_dir, not both"):
        load_recipe(recipe, overrides={"orchestrate.teacher.connect": ["tcp://127.0.0.1:9"],
                                       "orchestrate.teacher.run_dir": str(tmp)})
