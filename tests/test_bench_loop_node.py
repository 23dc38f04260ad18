"""bench/loop_node.py's reading of a run directory, on a hand-made one: which steps, keys and log
lines make each figure of its table (the bench itself runs every process, both arms)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def loop_node(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as `python bench/loop_node.py` has it
    import loop_node

    return loop_node


def write_run(run: Path, num_steps: int) -> None:
    (run / "metrics").mkdir(parents=True)
    (run / "logs").mkdir()
    train = [{"step": s, "time": 100.0 + 2.0 * s + (0.5 if s == 4 else 0.0), "compute_s": 0.1 * s, "publish_s": 0.01,
              "wait_s": 1.0 + s, "num_loss_tokens": 100, "mismatch_kl": 1e-3 * s, "off_policy_lag": s % 3,
              "router_disagreement": 0.01} for s in range(1, num_steps + 1)]
    orch = [{"step": s, "step_s": 3.0 + s, "wait_s": 1.0, "tokens_per_s": 50.0 * s, "completion_len_mean": 10.0 + s}
            for s in range(1, num_steps + 3)]  # the orchestrator ran ahead: its last two steps were never trained
    for name, rows in (("train", train), ("orchestrate", orch)):
        (run / "metrics" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "logs" / "sync-0.log").write_text(
        "00:00:01 rl-sync INFO policy v0 live on 1 server(s), 30.000s after rl-sync first saw it\n"
        + "".join(f"00:00:0{v} rl-sync INFO policy v{v} live on 1 server(s), {0.1 * v:.3f}s after rl-sync first "
                  "saw it\n" for v in range(1, num_steps + 1)))
    (run / "logs" / "infer-0.log").write_text(
        "".join(f"rl-infer INFO loaded policy v{v} in {0.05 * v:.2f}s (3 sequences kept running)\n"
                for v in range(1, num_steps + 1)))


def test_summary_reads_the_steps_after_warmup(loop_node, tmp_path):
    write_run(tmp_path, 6)
    r = loop_node.summarize(tmp_path, warmup=2)
    assert r["steps"] == 4
    assert r["step_s"] == pytest.approx(2.0)  # trainer periods 2.5, 1.5, 2.0 over steps 3-6
    assert r["generation_s"] == pytest.approx(6.5)  # orchestrator steps 3-6 only, less their wait
    assert r["orchestrator_step_s"] == pytest.approx(7.5) and r["orchestrator_wait_s"] == pytest.approx(1.0)
    assert r["train_compute_s"] == pytest.approx(0.45) and r["train_wait_s"] == pytest.approx(5.5)
    assert r["publish_s"] == pytest.approx(0.01)
    assert r["update_live_s"] == pytest.approx(0.45)  # v3-v6: policy 0's start-up and the warm-up left out
    assert r["infer_load_s"] == pytest.approx(0.225)
    assert r["train_tokens_per_s"] == pytest.approx(300 / 6.0)  # the tokens after the first measured step
    assert r["mismatch_kl"] == pytest.approx(4.5e-3) and r["mismatch_kl_max"] == pytest.approx(6e-3)
    assert r["router_disagreement"] == pytest.approx(0.01)
    assert r["completion_len"] == pytest.approx(14.5) and r["lag_max"] == 2
    text = loop_node.table(r, {**r, "step_s": 1.0}, 2)
    assert "max_async=2" in text.splitlines()[0]
    assert any(line.startswith("step time") and line.endswith("0.50x") for line in text.splitlines())


def test_too_few_steps_name_the_flags(loop_node, tmp_path):
    write_run(tmp_path, 3)
    with pytest.raises(ValueError, match="raise --steps or --timeout, or lower --warmup"):
        loop_node.summarize(tmp_path, warmup=2)


@pytest.mark.slow
def test_both_arms_run_on_the_cpu(tmp_path):
    """The bench end to end on its tiny CPU model: every process of both arms, the table, and the
    synchronous arm truly synchronous (no trained token from an older policy)."""
    out = subprocess.run([sys.executable, str(BENCH / "loop_node.py"), "--device", "cpu", "--steps", "4", "--warmup",
                          "1", "--keep", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    lines = out.stdout.splitlines()
    assert "rl-sync collective" in lines[0] and any(line.startswith("mismatch KL, mean") for line in lines)
    arms = json.loads(lines[-1])["arms"]
    assert arms["0"]["steps"] == arms["2"]["steps"] == 3
    assert arms["0"]["lag_max"] == 0 and arms["2"]["lag_max"] <= 2
    assert not (tmp_path / "max_async_0" / "checkpoints").exists()  # deleted after each arm
