"""The collective transport with several trainer ranks sending (``sync.backend.senders``).

Two trainer processes hold an FSDP2-sharded model (real gloo group); each stages only its
run of buckets and broadcasts it over its own group to two receivers, while this process
plays rl-sync over a real store. The receivers get the trainer's weights bit for bit, each
sender stages about half of them, a follower slow to see a round does not let its rank
restage before that round is sent, and a round taken before the trainer closes is sent."""

import json
import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlcli.infer.receiver import CollectiveReceiver
from rlcli.models.config import ModelArgs
from rlcli.models.hf_io import build_model, hf_state_dict
from rlcli.transport.collective import Spec, connect_store, host_store, parse_dtype, plan_buckets, plan_owners
from rlcli.transport.rendezvous import Control, write_store_file

pytestmark = pytest.mark.timeout(240)

CFG = {"model_type": "qwen3_moe", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
       "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
BUCKET = 4096


def reference():
    model = build_model(ModelArgs.from_hf(CFG))
    model.init_weights(7)
    return model


def cfg(root: str, senders: int, fp8=None):
    return SimpleNamespace(sync=SimpleNamespace(backend=SimpleNamespace(bucket_bytes=BUCKET, senders=senders),
                                                ack_timeout_s=40.0),
                           model=SimpleNamespace(path=root, dtype="float32"),
                           train=SimpleNamespace(fp8=SimpleNamespace(enabled=False, publish=False)),
                           infer=SimpleNamespace(fp8=fp8 or SimpleNamespace(enabled=False)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plan_owners_deals_contiguous_runs_of_about_equal_bytes():
    f32 = torch.float32
    specs = [Spec(f"t{i}", f32, (n,)) for i, n in enumerate([100, 100, 300, 50, 50, 200, 100, 100])]
    buckets = plan_buckets(specs, 400)
    assert plan_owners(specs, buckets, 1) == [0] * len(buckets)
    for senders in (2, 3, 4):
        owners = plan_owners(specs, buckets, senders)
        assert owners == sorted(owners) and owners[0] == 0 and owners[-1] == senders - 1
        share = [sum(specs[j].nbytes for b, o in zip(buckets, owners) if o == k for j in b) for k in range(senders)]
        total = sum(s.nbytes for s in specs)
        assert max(share) <= total / senders + max(sum(specs[j].nbytes for j in b) for b in buckets)
    assert plan_owners(specs, [[0, 1, 2, 3, 4, 5, 6, 7]], 3) == [1]  # fewer buckets than senders


def trainer(rank: int, port: int, root: str, addr: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from rlcli.train.publish_collective import CollectivePublisher

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:  # this follower sees the first round taken 2 s late
        wait, seen = Control.wait, []

        def slow(self, key, *args, **kwargs):
            value = wait(self, key, *args, **kwargs)
            if key == "accept/0" and isinstance(value, dict) and not seen:
                seen.append(key)
                time.sleep(2.0)
            return value

        Control.wait = slow
    model = reference()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    pub = CollectivePublisher(cfg(root, senders=2), root, lambda *a: None, torch.device("cpu"))
    returned = {}
    for version in (1, 2, 3):  # version v is the reference + v
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        pub.publish(version, model)
        returned[version] = time.time()
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump({"staged": pub.staging.numel(), "total": sum(s.nbytes for s in pub.specs),
                   "returned": returned}, f)
    store = connect_store(addr, 60)
    store.wait(["test/close"])
    pub.close()
    dist.destroy_process_group()


def expected(version: int) -> dict[str, torch.Tensor]:
    model = reference()
    with torch.no_grad():
        for _ in range(version):  # as the trainer adds it, rounding included
            for p in model.parameters():
                p.add_(1.0)
    return hf_state_dict(model)


def receive(ctl, addr, r, version, receivers, servers):
    published = ctl.published()
    assert published["version"] == version and published["senders"] == 2
    specs = [Spec(n, parse_dtype(d), tuple(s)) for n, d, s in published["tensors"]]
    errors = {}

    def load(i):
        try:
            receivers[i].load(servers[i], addr, "gen0", i + 1, 3, version, specs, published["bucket_bytes"], 30,
                              senders=2)
        except Exception as e:  # noqa: BLE001 - checked below
            errors[i] = e

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert ctl.wait(f"sent/{r}", 30)["error"] == "" and ctl.wait(f"sent/{r}/s1", 30)["error"] == ""
    want = expected(version)
    for server in servers:
        got = hf_state_dict(server)
        bad = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
        assert got.keys() == want.keys() and not bad, bad
    return time.time()


def test_two_senders_each_stage_half_and_the_servers_get_every_byte(tmp_path):
    store = host_store("127.0.0.1")
    addr = f"127.0.0.1:{store.port}"
    write_store_file(tmp_path, addr)
    ctl = Control(store)
    ctl.order(0, 1, "gen0", 3)  # open before the version it will carry, as rl-sync keeps it
    ctx = mp.start_processes(trainer, args=(free_port(), str(tmp_path), addr), nprocs=2, start_method="spawn",
                             join=False)
    servers = [build_model(ModelArgs.from_hf(CFG)) for _ in range(2)]
    receivers = [CollectiveReceiver(torch.device("cpu")) for _ in servers]
    try:
        assert ctl.wait("accept/0", 120) == {"version": 1}
        time.sleep(1.0)  # the trainer publishes v2 meanwhile: no sender may restage before round 0 is sent
        sent_v1 = receive(ctl, addr, 0, 1, receivers, servers)
        ctl.order(1, 2, "gen0", 3)
        assert ctl.wait("accept/1", 60) == {"version": 2}
        receive(ctl, addr, 1, 2, receivers, servers)
        assert all(len(r.groups) == 2 for r in receivers)  # one group per sender, kept across rounds
        ctl.order(2, 3, "gen0", 3)
        assert ctl.wait("accept/2", 60) == {"version": 3}
        store.set("test/close", "1")  # the trainer closes while round 2 waits for its servers...
        time.sleep(1.0)
        receive(ctl, addr, 2, 3, receivers, servers)  # ...and both senders still send it
    finally:
        store.set("test/close", "1")
        for r in receivers:
            r.close()
        ctx.join(60)
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    total = ranks[0]["total"]
    assert sum(r["staged"] for r in ranks) == total
    assert all(0.3 * total < r["staged"] < 0.7 * total for r in ranks), ranks
    assert all(r["returned"]["2"] >= sent_v1 - 0.5 for r in ranks)  # publish(2) waited for round 0


def stager(rank: int, port: int, root: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from rlcli.train.publish_collective import CollectivePublisher

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    fp8 = SimpleNamespace(enabled=True, include=["*"], exclude=["*embed_tokens", "lm_head", "*.mlp.gate"],
                          ue8m0=False)
    model = reference()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    pub = CollectivePublisher(cfg(root, senders=2, fp8=fp8), root, lambda *a: None, torch.device("cpu"))
    pub.stopping.set()  # no store here: stage only
    pub._plan(model)
    pub._stage(model)
    assert pub.staged == len(pub.mine)
    torch.save({"staging": pub.staging.clone(), "mine": pub.mine}, os.path.join(root, f"staging{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_two_senders_stage_fp8_weights_and_scales_as_one_sender_would(tmp_path):
    """With FP8 servers each linear travels as FP8 data + scales, two specs that a bucket cut can
    split between senders: each sender stages exactly its buckets' bytes of the one-sender stream."""
    from rlcli.train.publish_collective import CollectivePublisher

    mp.start_processes(stager, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    fp8 = SimpleNamespace(enabled=True, include=["*"], exclude=["*embed_tokens", "lm_head", "*.mlp.gate"],
                          ue8m0=False)
    one = CollectivePublisher(cfg(str(tmp_path), senders=1, fp8=fp8), tmp_path, lambda *a: None,
                              torch.device("cpu"))
    one.stopping.set()
    model = reference()
    one._plan(model)
    one._stage(model)
    parts = [torch.load(tmp_path / f"staging{k}.pt") for k in range(2)]
    assert parts[0]["mine"] + parts[1]["mine"] == list(range(len(one.buckets)))
    assert parts[0]["mine"] and parts[1]["mine"]
    assert any(s.name.endswith("weight_scale_inv") for s in one.specs)
    assert torch.equal(torch.cat([p["staging"] for p in parts]), one.staging)
    one.close()


def test_a_restarted_follower_resumes_at_a_round_rank_0_may_still_be_sending():
    from rlcli.train.publish_collective import CollectivePublisher

    ctl = Control(host_store("127.0.0.1"))
    resume = CollectivePublisher._resume_round
    assert resume(ctl) == 0
    ctl.order(0, 1, "gen0", 3)
    assert resume(ctl) == 0  # open: the next version takes it
    ctl.claim(0, 1)
    assert resume(ctl) == 0  # taken and not reported: rank 0 waits for this sender
    ctl.sent(0, "", {})
    assert resume(ctl) == 1
    ctl.order(1, 2, "gen0", 3)
    ctl.withdraw(1)
    assert resume(ctl) == 2
