"""The weight-transfer pieces in one process: the real collective publisher and receivers
over a real gloo group (ranks as threads), the filesystem publisher and the verified
loader, torn shards, and the status view."""

import json
import threading
from types import SimpleNamespace

import pytest
import torch

from rlcli.errors import ModelLoadError
from rlcli.infer.receiver import CollectiveReceiver, load_from_files
from rlcli.models.config import ModelArgs
from rlcli.models.hf_io import build_model, hf_state_dict
from rlcli.sync.status import render
from rlcli.train.publish import AsyncFilesystemPublisher, FilesystemPublisher
from rlcli.train.publish_collective import CollectivePublisher
from rlcli.transport.collective import Spec, host_store, parse_dtype, plan_buckets
from rlcli.transport.rendezvous import Control, write_store_file

pytestmark = pytest.mark.timeout(120)

MOE = {"model_type": "qwen3_moe", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
       "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


def model(seed: int, dtype=torch.float32, **overrides):
    m = build_model(ModelArgs.from_hf({**MOE, **overrides}), dtype=dtype)
    m.init_weights(seed)
    return m


def same(a, b, dtype=None) -> bool:
    sa, sb = hf_state_dict(a), hf_state_dict(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].to(dtype or sa[k].dtype), sb[k]) for k in sa)


def cfg(tmp_path, bucket_bytes=4096, infer_fp8=None):
    return SimpleNamespace(sync=SimpleNamespace(backend=SimpleNamespace(bucket_bytes=bucket_bytes), ack_timeout_s=60.0),
                           model=SimpleNamespace(path=str(tmp_path), dtype="float32"),
                           train=SimpleNamespace(fp8=SimpleNamespace(enabled=False, publish=False)),
                           infer=SimpleNamespace(fp8=infer_fp8 or SimpleNamespace(enabled=False)))


def test_plan_buckets_packs_small_tensors_and_sends_large_ones_alone():
    f32 = torch.float32
    specs = [Spec("a", f32, (10,)), Spec("b", f32, (10,)), Spec("big", f32, (100,)), Spec("c", f32, (20,)),
             Spec("d", f32, (5,))]
    assert plan_buckets(specs, 100) == [[0, 1], [2], [3, 4]]
    assert plan_buckets(specs, 99) == [[0, 1], [2], [3], [4]]
    assert plan_buckets(specs, 1000) == [[0, 1, 2, 3, 4]]
    assert plan_buckets(specs, 0) == [[0], [1], [2], [3], [4]]


def test_an_open_round_is_taken_or_withdrawn_exactly_once():
    ctl = Control(host_store("127.0.0.1"))
    ctl.order(0, 1, "gen0", 3)
    assert ctl.open_round() == 0  # a restarted sender resumes at the round nobody answered
    assert ctl.claim(0, 2) and not ctl.withdraw(0) and ctl.accepted(0) == {"version": 2}
    assert ctl.open_round() == 1
    ctl.order(1, 3, "gen1", 2)
    assert ctl.withdraw(1) and not ctl.claim(1, 3) and ctl.withdrawn(1) and ctl.accepted(1) == "withdrawn"
    assert ctl.open_round() == 2


def test_collective_publisher_to_two_receivers_over_gloo(tmp_path):
    store = host_store("127.0.0.1")
    addr = f"127.0.0.1:{store.port}"
    write_store_file(tmp_path, addr)
    ctl = Control(store)
    trainer = model(1)
    pub = CollectivePublisher(cfg(tmp_path), tmp_path, lambda *a: None, torch.device("cpu"))
    servers = [model(2), model(3, dtype=torch.bfloat16), model(4, num_experts=8)]  # the last one does not fit
    before = [hf_state_dict(s)["model.layers.0.mlp.experts.3.up_proj.weight"].clone() for s in servers]
    receivers = [CollectiveReceiver(torch.device("cpu")) for _ in servers]
    try:
        for r, version in enumerate((1, 2)):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.5)
            if r == 1:  # a loader replaced a parameter's storage: the arena is rebuilt, not written past it
                p0 = next(servers[0].parameters())
                p0.data = p0.data.clone()
            ctl.order(r, version, "gen0", 4)  # open before the version it will carry, as rl-sync keeps it
            pub.publish(version, trainer)
            assert ctl.wait(f"accept/{r}", 30) == {"version": version}
            published = ctl.published()
            assert published["version"] == version
            specs = [Spec(n, parse_dtype(d), tuple(s)) for n, d, s in published["tensors"]]
            errors: dict[int, Exception] = {}

            def load(i):
                try:
                    receivers[i].load(servers[i], addr, "gen0", i + 1, 4, version, specs, published["bucket_bytes"],
                                      30)
                except Exception as e:  # noqa: BLE001 - recorded and checked below
                    errors[i] = e

            threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert ctl.wait(f"sent/{r}", 30)["error"] == ""
            assert same(trainer, servers[0]), "fp32 server is not bit-identical to the trainer"
            assert same(trainer, servers[1], torch.bfloat16), "bf16 server is not the trainer's weights in bf16"
            assert set(errors) == {2} and isinstance(errors[2], ModelLoadError), errors
            assert receivers[0].group is not None  # the group of the generation is reused by the next round
            # fp32 server: every parameter is a view of the arena the bytes landed in; bf16: copied out of it
            flat = receivers[0].arena.flat
            assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                       for p in servers[0].parameters())
            assert receivers[1].arena.num_bound == 0 and receivers[1].arena.copies
        mine = hf_state_dict(servers[2])["model.layers.0.mlp.experts.3.up_proj.weight"]
        assert torch.equal(mine, before[2]), "a receiver that refused the transfer changed its parameters"
        assert not any(r.torn for r in receivers)
    finally:
        pub.close()
        for r in receivers:
            r.close()


def test_collective_publish_to_a_server_holding_fp8_linears(tmp_path):
    """A server with infer.fp8 keeps its linears as FP8 data + weight_scale_inv: the trainer's
    high-precision weights reach it quantized (128x128 blocks, bit for bit what the filesystem
    path writes), the experts and the rest in the model's dtype. Before, the transfer was
    refused: it lacked the scales."""
    from rlcli.config.model import Fp8Config
    from rlcli.models.fp8_io import SCALE_SUFFIX
    from rlcli.ops.fp8.convert import convert_to_fp8
    from rlcli.ops.fp8.quant import FP8_DTYPE, quantize_128x128

    fp8 = Fp8Config(enabled=True, backend="emulated")
    store = host_store("127.0.0.1")
    addr = f"127.0.0.1:{store.port}"
    write_store_file(tmp_path, addr)
    ctl = Control(store)
    trainer, server = model(1), model(2)
    convert_to_fp8(server, fp8, device="cpu", fp8_storage=True)
    pub = CollectivePublisher(cfg(tmp_path, infer_fp8=fp8), tmp_path, lambda *a: None, torch.device("cpu"))
    receiver = CollectiveReceiver(torch.device("cpu"))
    try:
        ctl.order(0, 1, "gen0", 2)
        pub.publish(1, trainer)
        assert ctl.wait("accept/0", 30) == {"version": 1}
        published = ctl.published()
        specs = [Spec(n, parse_dtype(d), tuple(s)) for n, d, s in published["tensors"]]
        receiver.load(server, addr, "gen0", 1, 2, 1, specs, published["bucket_bytes"], 30)
        assert ctl.wait("sent/0", 30)["error"] == ""
        want, got = hf_state_dict(trainer), hf_state_dict(server)
        quantized = [n for n, t in got.items() if t.dtype == FP8_DTYPE]
        assert "model.layers.0.self_attn.q_proj.weight" in quantized and not any(".experts." in n for n in quantized)
        for name, t in got.items():
            if name in quantized:
                q, scale = quantize_128x128(want[name])
                assert torch.equal(t.view(torch.uint8), q.view(torch.uint8)), name
                assert torch.equal(got[name + SCALE_SUFFIX], scale), name
            elif not name.endswith(SCALE_SUFFIX):
                assert torch.equal(t, want[name]), name
    finally:
        pub.close()
        receiver.close()


@pytest.mark.parametrize("publisher", [FilesystemPublisher, AsyncFilesystemPublisher])
def test_filesystem_publish_then_verified_load(tmp_path, publisher):
    announced = []
    trainer, server = model(1), model(2)
    pub = publisher(cfg(tmp_path), tmp_path / "weights", lambda *a: announced.append(a))
    pub.publish(5, trainer)
    pub.wait()
    step_dir = tmp_path / "weights" / "step_5"
    marker = json.loads((step_dir / "STABLE").read_text())
    assert announced[0][:2] == (5, str(step_dir)) and {"gather_s", "write_s"} <= set(announced[0][2])
    assert marker["files"] and all((step_dir / f).stat().st_size == n for f, n in marker["files"].items())
    load_from_files(server, step_dir)
    assert same(trainer, server)
    pub.close()


def test_torn_or_unmarked_shard_is_never_loaded(tmp_path):
    trainer, server = model(1), model(2)
    pub = FilesystemPublisher(cfg(tmp_path), tmp_path / "weights", lambda *a: None)
    pub.publish(1, trainer)
    step_dir = tmp_path / "weights" / "step_1"
    before = {k: v.clone() for k, v in hf_state_dict(server).items()}
    shard = next(step_dir.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # torn: STABLE still claims the full size
    with pytest.raises(ModelLoadError, match="torn shard"):
        load_from_files(server, step_dir)
    (step_dir / "STABLE").unlink()
    shard.write_bytes(data)
    with pytest.raises(ModelLoadError, match="no STABLE marker"):
        load_from_files(server, step_dir)
    assert all(torch.equal(v, before[k]) for k, v in hf_state_dict(server).items())


def test_a_dead_publishers_temporary_is_known_as_its_hosts_and_removed(tmp_path, monkeypatch):
    """The publisher's shared temporary carries rank 0's <host>-r0-<pid>, as every other temporary:
    the trainer's restart removes a dead publisher's (here a pid that no longer runs on this host),
    where a name without the rank was judged by the old rule only."""
    from rlcli.transport import atomic

    pub = FilesystemPublisher(cfg(tmp_path), tmp_path / "weights", lambda *a: None)
    assert atomic._TEMP_RE.search(f".step_1.tmp-{pub.token}").group("rank") == "0"
    pub.close()
    dead = tmp_path / "weights" / f".step_2.tmp-{atomic._HOST}-r0-999999999"
    (dead / "sub").mkdir(parents=True)
    atomic.clean_temporaries(tmp_path / "weights")
    assert not dead.exists()


def test_status_names_each_server_and_the_update_breakdown():
    text = render({"backend": "collective", "policy_version": 4, "latest_published": 5,
                   "servers": {"infer-0": {"version": 4, "state": "admitted", "host": "h", "pid": 1, "last_error": ""},
                               "infer-1": {"version": 3, "state": "skipped", "host": "h", "pid": 2,
                                           "last_error": ""}},
                   "last_update": {"version": 4, "gather_s": 0.01, "send_s": 0.2, "load_s": 0.25, "total_s": 0.3}})
    assert "infer-1      v3      skipped" in text
    assert "last update v4: gather 0.010s, send 0.200s, load 0.250s, total 0.300s" in text


def test_a_round_sends_each_bucket_only_once_it_is_staged(tmp_path):
    """The sender may start a round while the trainer is still staging: bucket k is handed to
    the broadcast only after the staging copy has passed its last byte."""
    pub = CollectivePublisher(cfg(tmp_path, bucket_bytes=2048), tmp_path, lambda *a: None, torch.device("cpu"))
    try:
        src = model(3)
        pub._plan(src)
        assert len(pub.ranges) > 3
        got: list[int] = []
        consumer = threading.Thread(target=lambda: got.extend(int(b.numel()) for b in pub._ready_buckets()))
        consumer.start()
        consumer.join(0.3)
        assert consumer.is_alive() and got == []  # nothing staged yet: the round waits
        pub._mark_staged(pub.ranges[1][1])  # the first two buckets are complete
        consumer.join(0.3)
        assert [g for g in got] == [b - a for a, b in pub.ranges[:2]] and consumer.is_alive()
        pub._stage(src)  # the rest
        consumer.join(10)
        assert not consumer.is_alive() and got == [b - a for a, b in pub.ranges]
    finally:
        pub.close()
