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


def test_samples_reach_the_sinks_as_tables(tmp_path):
    """orchestrate.log_samples and evaluations: a W&B Table under <command>/samples at the step, and a
    TensorBoard text panel of the same name, one row per completion."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_recipe(None, {"run_dir": str(tmp_path / "run"), "monitor.wandb": True, "monitor.wandb_mode": "offline",
                             "monitor.tensorboard": True})
    run = RunDir(cfg.run_dir)
    run.sinks = make_sinks(cfg, run.root, "orchestrate")
    records = [{"prompt": "ab|c=", "answer": "c|ba", "completions": ["cba", "c|ba"], "rewards": [0.5, 1.0],
                "advantages": [-0.25, 0.25]}]
    run.append_metrics("orchestrate", {"step": 3, "reward_mean": 0.75})
    run.mirror_samples("orchestrate", 3, records)
    for sink in run.sinks:
        sink.close()
    assert len(run.sinks) == 2  # neither failed
    [row] = [r for r in wandb_history(run.root) if "orchestrate/samples/_type" in r]
    assert row["orchestrate/step"] == 3 and row["orchestrate/samples/_type"] == "table-file"
    [table] = run.root.glob(f"wandb/offline-run-*/files/{row['orchestrate/samples/path']}")
    data = json.loads(table.read_text())
    assert data["columns"] == ["prompt", "answer", "completion", "reward", "advantage"]
    assert data["data"] == [["ab|c=", "c|ba", "cba", 0.5, -0.25], ["ab|c=", "c|ba", "c|ba", 1.0, 0.25]]
    acc = EventAccumulator(str(run.root / "tensorboard" / "orchestrate"))
    acc.Reload()
    [event] = acc.Tensors("orchestrate/samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "| ab\\|c= | c\\|ba | c\\|ba | 1.0 | 0.25 |" in text


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


def test_rl_infer_and_rl_cache_append_a_record_for_each_busy_interval(tmp_path, tiny_model_dir):
    """Servers have no steps: every metrics_interval_s in which they worked is one record of
    RUN/metrics/<command>.jsonl (rates over the interval, gauges at its end); idle intervals write none."""
    import threading
    import time

    from procs import serve_initial_policy, wait_until, write_recipe
    from rlcli.cache.server import CacheService, record_metrics
    from rlcli.cache.store import MemoryStore
    from rlcli.infer.server import InferServer
    from rlcli.protocol import GenerateRequest, GenerateResponse, SamplingParams
    from rlcli.transport.interval import IntervalCounters
    from rlcli.transport.zmq import RpcClient, new_request_id

    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir, model={"max_seq_len": 128},
                          infer={"metrics_interval_s": 0.2})
    serve_initial_policy(run_dir, tiny_model_dir)
    server = InferServer(load_recipe(recipe), RunDir(run_dir), 3)
    thread = threading.Thread(target=server.serve)
    thread.start()
    client = RpcClient(server.server.endpoint)
    try:
        for _ in range(2):
            reply = client.call(GenerateRequest(request_id=new_request_id(), prompt_ids=[5, 6, 7],
                                                sampling=SamplingParams(max_tokens=40, ignore_eos=True, n=4)), 60)
            assert isinstance(reply, GenerateResponse)
        records = wait_until(lambda: RunDir(run_dir).read_metrics("infer-3"), 30, "an rl-infer record")
        time.sleep(0.6)  # idle intervals: no more records
        assert len(RunDir(run_dir).read_metrics("infer-3")) == len(records)
    finally:
        server.stopping = True
        thread.join()
        client.close()
        server.close()
    records = RunDir(run_dir).read_metrics("infer-3")
    assert sum(r["gen_tokens_per_s"] * r["interval_s"] for r in records) == pytest.approx(2 * 4 * 40)
    assert sum(r["requests"] for r in records) == 2 and all(r["version"] == 0 for r in records)
    assert [r["step"] for r in records] == sorted({r["step"] for r in records})
    assert {"prefix_hit_rate", "kv_usage", "num_running", "num_waiting", "step_ms"} <= set(records[0])

    run = RunDir(tmp_path / "cache-run")
    service = CacheService(MemoryStore(1 << 20))
    interval = IntervalCounters(0.01)
    service.store.put([b"a", b"b"], [b"x" * 10, b"y" * 10])
    service.store.get([b"a", b"c"])
    record_metrics(run, service, interval)
    record_metrics(run, service, interval)  # nothing happened since: no record
    [record] = run.read_metrics("cache")
    assert (record["puts"], record["hits"], record["misses"], record["hit_rate"]) == (2, 1, 1, 0.5)
    assert record["num_blocks"] == 2 and record["bytes_used"] == 20
