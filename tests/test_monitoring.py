"""W&B (offline) and TensorBoard record the same scalars as metrics.jsonl, through the real libraries."""

import json
import struct
from pathlib import Path

import pytest

from rlcli.config import load_recipe
from rlcli.transport.rundir import RunDir
from rlcli.transport.sinks import make_sinks

pytest.importorskip("wandb")
pytest.importorskip("tensorboard")


def wandb_history(run_root: Path) -> list[dict]:
    """History rows of the offline run under RUN/wandb (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_root.glob("wandb/offline-run-*/*.wandb")
    data, pos, block, rows, buf = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        buf = payload if kind in (1, 2) else buf + payload
        if kind in (2, 3):
            continue  # a record continues in the next block
        record = pb.Record()
        record.ParseFromString(buf)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_sinks_mirror_the_metrics_files(tmp_path):
    cfg = load_recipe(None, {"run_dir": str(tmp_path / "run"), "monitor.wandb": True, "monitor.wandb_mode": "offline",
                             "monitor.tensorboard": True})
    run = RunDir(cfg.run_dir)
    run.sinks = make_sinks(cfg, run.root, "train")
    for s in (10, 20):  # rl-train logs its SFT warm-up first, then RL steps from 1: separate step axes
        run.append_metrics("sft", {"step": s, "loss": 2.0 / s})
    for s in range(1, 4):
        run.append_metrics("train", {"step": s, "loss": 0.5 / s, "mismatch_kl": 1e-4 * s, "lag": s % 2,
                                     "note": "text is skipped", "ok": True})
    for sink in run.sinks:
        sink.close()

    expected = {f"{cmd}/{k}": [(m["step"], float(v)) for m in run.read_metrics(cmd) for kk, v in m.items() if kk == k]
                for cmd in ("sft", "train") for k in ("loss", "mismatch_kl", "lag")}
    expected = {k: v for k, v in expected.items() if v}

    tb = tensorboard_scalars(run.root / "tensorboard" / "train")
    assert set(tb) == set(expected)
    for tag, points in expected.items():
        assert [(s, pytest.approx(v, rel=1e-6)) for s, v in points] == tb[tag]

    rows = wandb_history(run.root)
    got: dict[str, list] = {}
    for row in rows:
        for key, value in row.items():
            cmd, _, name = key.partition("/")
            if name and name != "step":
                got.setdefault(key, []).append((row[f"{cmd}/step"], value))
    assert got == expected


def test_a_failing_sink_is_dropped_and_the_metrics_file_is_written(tmp_path):
    class Broken:
        def log(self, command, record):
            raise RuntimeError("down")

        def close(self):
            pass

    run = RunDir(tmp_path / "run")
    run.sinks = [Broken()]
    run.append_metrics("train", {"step": 1, "loss": 1.0})
    run.append_metrics("train", {"step": 2, "loss": 0.5})
    assert run.sinks == [] and [m["step"] for m in run.read_metrics("train")] == [1, 2]
