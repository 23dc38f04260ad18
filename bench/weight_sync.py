"""Weight-update latency per transport against the bandwidth floor of the same bytes.

For each transport (collective, filesystem, async_filesystem) the script runs a trainer
process and N server processes holding the same model architecture:

- update latency: from the trainer's weights being ready (after its step) to the last
  server having them in its parameters; the trainer publishes with the real
  ``WeightPublisher``, servers load with the real receiver (``rlcli.infer.receiver``), and
  this script plays rl-sync's part (orders each round through the store, collects acks);
- where the time goes (collective): the median moment, after the trainer's weights are
  ready, of each hop: the trainer's publish returns, the
  round (kept open for the next version, as rl-sync does) is taken, the server gets the
  order, and its load ends; the sender's own split (joining the group, sending); and the
  median moment each sender and receiver phase ended;
- floor: the same bytes moved by a raw ``torch.distributed`` broadcast of one flat tensor
  in a group of the same members (collective), or a raw write + fsync of one file and its
  read by every server (filesystem);
- the ratio of the two. Medians over ``--updates`` updates; every server's weights are
  checked bit-identical to the trainer's at the end.

Several trainer ranks: ``--train-nproc N`` runs the trainer as N processes in one
``torch.distributed`` group (gloo, NCCL with ``--gpu``), the model FSDP2-sharded as rl-train
shards it, every rank publishing each version; ``--senders 1,2`` runs the collective transport
once per ``sync.backend.senders`` value (the other transports once). It then also prints the
largest share of the transfer one rank staged (senders split it).

Needs torch, safetensors and rich only (no pyzmq/msgspec), so it runs as-is on a GPU box:
``--gpu`` puts trainer rank k on cuda:k and server r on the GPU after the trainer's, and uses
NCCL (a sender and its servers must sit on different GPUs: 2 senders and 1 server take 3).

    python bench/weight_sync.py --smoke --train-nproc 2 --senders 1,2 --modes collective
    python bench/weight_sync.py --gpu --train-nproc 2 --senders 1,2 --modes collective   # 3 GPUs
"""

import argparse
import json
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MODELS = {  # Llama-3-style configs (bf16 on GPU): ~2.5 GB and ~6.4 GB
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=259),
    "cpu": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, vocab_size=128256),
}


def hf_config(size: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
            "bos_token_id": 0, "eos_token_id": 1, **MODELS[size]}


def build(args, device: torch.device, seed: int, dtype: str | None = None):
    from rlcli.models.config import ModelArgs
    from rlcli.models.hf_io import build_model

    dtype = getattr(torch, dtype or args.dtype)
    model = build_model(ModelArgs.from_hf(hf_config(args.model)), device=device, dtype=dtype)
    model.init_weights(seed)
    return model


def fake_cfg(args, model_dir: Path):
    backend = SimpleNamespace(bucket_bytes=int(args.bucket_mb * 2**20), senders=args.senders)
    return SimpleNamespace(sync=SimpleNamespace(backend=backend, ack_timeout_s=120.0),
                           model=SimpleNamespace(path=str(model_dir), dtype=args.dtype),
                           train=SimpleNamespace(fp8=SimpleNamespace(enabled=False, publish=False)),
                           infer=SimpleNamespace(fp8=SimpleNamespace(enabled=False)))


def checksum(model, dtype: str) -> str:
    """sha256 of every HF tensor's bytes in ``dtype`` (what servers hold): equal digests
    mean bit-identical weights. A sharded model's tensors are gathered (every trainer rank runs it)."""
    import hashlib

    from rlcli.train.publish import iter_hf_tensors
    from rlcli.transport.collective import as_bytes

    h = hashlib.sha256()
    for _, name, t in iter_hf_tensors(model):
        h.update(name.encode())
        h.update(as_bytes(t.to(getattr(torch, dtype)).contiguous()).cpu().numpy().tobytes())
    return h.hexdigest()


def device_of(args, role: int) -> torch.device:
    """Trainer rank k's device is role k, server r's (1-based) role ``train_nproc + r - 1``."""
    return torch.device(f"cuda:{role}") if args.gpu else torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ processes


def trainer(args, mode: str, run_root: str, to_parent, from_parent, rank: int = 0, port: int = 0) -> None:
    import torch.distributed as dist

    from rlcli.train.publish import AsyncFilesystemPublisher, FilesystemPublisher
    from rlcli.train.publish_collective import CollectivePublisher
    from rlcli.transport.collective import WeightGroup, connect_store

    device = device_of(args, rank)
    sharded = args.train_nproc > 1
    if sharded:  # rl-train's ranks: one group, the model FSDP2-sharded over it
        from torch.distributed.fsdp import fully_shard

        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=args.train_nproc)
    model = build(args, device, seed=1, dtype=args.trainer_dtype)
    if sharded:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    lead = rank == 0  # talks to this script, as rank 0 talks to rl-sync
    cfg = fake_cfg(args, Path(run_root))
    # The collective sender also announces to wake rl-sync (timing not in yet): only the final one counts here.
    announce = lambda step, path, timing: to_parent.put(("published", step, path, timing)) \
        if lead and (mode != "collective" or timing) else None  # noqa: E731
    pub = {"collective": CollectivePublisher, "filesystem": FilesystemPublisher,
           "async_filesystem": AsyncFilesystemPublisher}[mode]
    pub = (pub(cfg, Path(run_root), announce, device) if mode == "collective"
           else pub(cfg, Path(run_root) / "weights", announce))
    for v in range(1, args.updates + 2):
        assert from_parent.get() == "go"
        with torch.no_grad():  # the "optimizer step" (on each rank's shards)
            for p in model.parameters():
                p.mul_(1.0 + 1e-3 * v)
        sync(device)
        t_ready = time.monotonic()
        pub.publish(v, model)
        if lead:
            to_parent.put(("ready", v, t_ready, time.monotonic() - t_ready))
    pub.wait()
    assert from_parent.get() == "close"
    if lead:
        to_parent.put(("trace", dict(getattr(pub, "trace", {}))))
    wire = getattr(torch, args.dtype).itemsize
    total = sum(p.numel() * wire for p in model.parameters())  # the full sizes, sharded or not
    digest = checksum(model, args.dtype)
    if lead:
        to_parent.put(("checksum", digest, total))
    staging = getattr(pub, "staging", None)
    to_parent.put(("staged", rank, staging.numel() if staging is not None else 0))
    pub.close()
    if mode == "collective" and lead:  # the floor: one flat tensor of the same bytes, one sender, same servers
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        addr = json.loads((Path(run_root) / "sync" / "store.json").read_text())["addr"]
        group = WeightGroup(connect_store(addr, 60), "floor", 0, args.servers + 1, device, 300)
        for _ in range(args.updates + 1):
            group.broadcast(flat[:8], block=False)  # line up with the receivers (fine-grained wait)
            group.synchronize()
            sync(device)
            t0 = time.monotonic()
            group.broadcast(flat, block=False)  # then the same bounded wait a transfer ends with
            group.synchronize()
            to_parent.put(("floor_start", t0, total))
        group.close()
    if sharded:
        dist.destroy_process_group()
    to_parent.put(("done",))


def server(args, mode: str, rank: int, run_root: str, to_parent, from_parent) -> None:
    from rlcli.infer.receiver import CollectiveReceiver, load_from_files
    from rlcli.transport.collective import Spec, WeightGroup, connect_store, parse_dtype

    device = device_of(args, args.train_nproc + rank - 1 if args.gpu else 0)
    model = build(args, device, seed=100 + rank)
    receiver = CollectiveReceiver(device)
    last_tensors, specs = None, []
    while (msg := from_parent.get()) != "close":
        t0 = time.monotonic()  # the order reached the server
        if mode == "collective":
            v, store, group, world, tensors, bucket_bytes, senders = msg
            if tensors != last_tensors:  # parsed once, as rl-infer's WeightReceiver does
                last_tensors, specs = tensors, [Spec(n, parse_dtype(d), tuple(s)) for n, d, s in tensors]
            receiver.load(model, store, group, rank, world, v, specs, bucket_bytes, 120.0, senders=senders)
        else:
            v, path = msg
            load_from_files(model, path)
        sync(device)
        to_parent.put(("loaded", rank, v, time.monotonic(), time.monotonic() - t0, t0, dict(receiver.at)))
    to_parent.put(("checksum", checksum(model, args.dtype)))
    receiver.close()
    if mode == "collective":
        total = sum(t.numel() * t.element_size() for t in model.parameters())
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        addr = json.loads((Path(run_root) / "sync" / "store.json").read_text())["addr"]
        group = WeightGroup(connect_store(addr, 60), "floor", rank, args.servers + 1, device, 300)
        for _ in range(args.updates + 1):
            group.broadcast(flat[:8], block=False)
            group.synchronize()
            group.broadcast(flat, block=False)
            group.synchronize()
            to_parent.put(("floor_end", time.monotonic()))
        group.close()
    to_parent.put(("done",))


# ------------------------------------------------------------------ rl-sync's part


def run_mode(args, mode: str) -> dict:
    from rlcli.transport.collective import host_store
    from rlcli.transport.rendezvous import Control, write_store_file

    ctx = mp.get_context("spawn")
    run_root = Path(tempfile.mkdtemp(prefix=f"ws-{mode}-", dir=args.tmp))
    (run_root / "weights").mkdir()
    store = host_store("127.0.0.1")
    addr = f"127.0.0.1:{store.port}"
    write_store_file(run_root, addr)
    ctl = Control(store)
    up = ctx.Queue()
    t_qs, s_qs = [ctx.Queue() for _ in range(args.train_nproc)], [ctx.Queue() for _ in range(args.servers)]
    port = free_port()
    procs = [ctx.Process(target=trainer, args=(args, mode, str(run_root), up, q, k, port)) for k, q in enumerate(t_qs)]
    procs += [ctx.Process(target=server, args=(args, mode, r + 1, str(run_root), up, q)) for r, q in enumerate(s_qs)]
    for p in procs:
        p.start()
    pending: list = []

    def wait_for(kind: str):
        for i, m in enumerate(pending):
            if m[0] == kind:
                return pending.pop(i)
        deadline = time.monotonic() + 600
        while True:
            try:
                m = up.get(timeout=2)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise SystemExit(f"weight_sync {mode}: waiting for {kind!r}: " + (
                        f"a process exited with {dead[0].exitcode} (its traceback is above)" if dead else "timed out"))
                continue
            if m[0] == kind:
                return m
            pending.append(m)

    e2e, publish_s, load_s, hops = [], [], [], []
    at_server: dict[int, list[dict]] = {}  # version -> each server receiver's phase times
    ready_at: dict[int, float] = {}
    for v in range(1, args.updates + 2):  # update 1 warms up (builds the group), not counted
        if mode == "collective":  # as rl-sync: a round stays open for the next version; the trainer takes it
            r = v - 1
            ctl.order(r, v, "g0", args.servers + 1)
        for q in t_qs:
            q.put("go")
        if mode == "collective":
            while not isinstance(a := ctl.accepted(r), dict):
                time.sleep(0.0002)
            t_accepted = time.monotonic()
            assert a["version"] == v, a
            p = ctl.published()
            assert p["version"] == v, p["version"]
            for rank, q in enumerate(s_qs, 1):
                q.put((v, addr, "g0", args.servers + 1, p["tensors"], p["bucket_bytes"], p.get("senders", 1)))
        else:
            _, _, t_ready, pub_s = wait_for("ready")
            _, step, path, timing = wait_for("published")
            for q in s_qs:
                q.put((v, path))
        acks = [wait_for("loaded") for _ in s_qs]
        if mode == "collective":
            _, _, t_ready, pub_s = wait_for("ready")
            wait_for("published")
            while (o := ctl.outcome(r)) is None:
                time.sleep(0.0005)
            sender = o.get("timing") or {}
            if v > 1:
                hops.append({"publish returned": pub_s, "round taken": t_accepted - t_ready,
                             "server has order": min(a[5] for a in acks) - t_ready,
                             "server loaded": max(a[3] for a in acks) - t_ready,
                             "sender: join group": sender.get("group_s", float("nan")),
                             "sender: send": sender.get("send_s", float("nan"))})
                at_server[v] = [a[6] for a in acks]
                ready_at[v] = t_ready
        if v > 1:
            e2e.append(max(a[3] for a in acks) - t_ready)
            publish_s.append(pub_s)
            load_s.append(max(a[4] for a in acks))
        if mode != "collective":
            shutil.rmtree(path, ignore_errors=True)
    for q in [*t_qs, *s_qs]:
        q.put("close")
    trace = wait_for("trace")[1]
    sums = [wait_for("checksum") for _ in range(1 + args.servers)]
    staged = [wait_for("staged")[2] for _ in t_qs]
    identical = all(s[1] == sums[0][1] for s in sums)
    nbytes = max(s[2] for s in sums if len(s) > 2)
    if mode == "collective":
        floors = []
        for _ in range(args.updates + 1):
            start = wait_for("floor_start")[1]
            floors.append(max(wait_for("floor_end")[1] for _ in s_qs) - start)
        floor = statistics.median(floors[1:])  # the first one builds the communicator
    else:
        floor = file_floor(run_root, nbytes, args.servers)
    for _ in procs:
        wait_for("done")
    for p in procs:  # everything is reported; a process stuck in a group's teardown is ended
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    shutil.rmtree(run_root, ignore_errors=True)
    return {"mode": mode, "bytes": nbytes, "staged_share": max(staged) / nbytes,
            "update_s": statistics.median(e2e), "update_min_s": min(e2e),
            "publish_blocks_s": statistics.median(publish_s), "load_s": statistics.median(load_s),
            "floor_s": floor, "ratio": statistics.median(e2e) / floor, "bit_identical": identical,
            "timeline_s": {k: statistics.median(h[k] for h in hops) for k in hops[0]} if hops else {},
            "phases_s": phases(ready_at, trace, at_server)}


SENDER_PHASES = [("staged", "trainer: staging copies done"), ("posted", "sender: version posted"),
                 ("accepted", "sender: round taken"), ("joined", "sender: group joined"),
                 ("header", "sender: header queued"), ("issued", "sender: buckets queued"),
                 ("sent", "sender: last byte sent")]
SERVER_PHASES = [("start", "server: order in hand"), ("joined", "server: group joined"),
                 ("arena", "server: arena built"), ("header", "server: header through"),
                 ("received", "server: bytes landed"), ("loaded", "server: load returned")]


def phases(ready_at: dict, trace: dict, at_server: dict) -> dict[str, float]:
    """Median moment of each sender and receiver phase after the weights were ready (both
    processes stamp ``time.monotonic()``, one clock on one host)."""
    out = {}
    for key, label in SENDER_PHASES:
        ts = [trace[v][key] - t for v, t in ready_at.items() if key in trace.get(v, {})]
        if ts:
            out[label] = statistics.median(ts)
    for key, label in SERVER_PHASES:
        ts = [max(a[key] for a in at_server[v]) - t for v, t in ready_at.items()
              if all(key in a for a in at_server[v])]
        if ts:
            out[label] = statistics.median(ts)
    return out


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def file_floor(run_root: Path, nbytes: int, readers: int) -> float:
    """Raw write + fsync of one file of ``nbytes``, then ``readers`` reads of it, in this process."""
    data = torch.empty(nbytes, dtype=torch.uint8).numpy()
    out = torch.empty(nbytes, dtype=torch.uint8).numpy()
    best = float("inf")
    for _ in range(3):
        path = run_root / "floor.bin"
        t0 = time.monotonic()
        with open(path, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        for _ in range(readers):
            with open(path, "rb") as f:
                f.readinto(memoryview(out))
        best = min(best, time.monotonic() - t0)
        path.unlink()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="trainer rank k on cuda:k, the server on the next GPU, NCCL")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 updates: checks the script runs")
    ap.add_argument("--model", choices=list(MODELS), default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--trainer-dtype", default=None,
                    help="the trainer's parameter dtype (float32: FSDP2-style masters, cast to --dtype when published); "
                         "a comma list runs each")
    ap.add_argument("--servers", type=int, default=None)
    ap.add_argument("--updates", type=int, default=None)
    ap.add_argument("--bucket-mb", default="256", help="bucket size in MiB (fractions allowed); a comma list runs each")
    ap.add_argument("--modes", default="collective,filesystem,async_filesystem")
    ap.add_argument("--tmp", default=None, help="directory for the filesystem modes (default: the system temp)")
    ap.add_argument("--train-nproc", type=int, default=1, help="trainer ranks (FSDP2-sharded, one process group)")
    ap.add_argument("--senders", default="1",
                    help="sync.backend.senders for the collective transport; a comma list runs each")
    args = ap.parse_args()
    senders = [int(k) for k in args.senders.split(",")]
    if max(senders) > args.train_nproc:
        ap.error(f"--senders {max(senders)} is more than --train-nproc {args.train_nproc}: raise --train-nproc")
    args.model = args.model or ("smoke" if args.smoke else "1b" if args.gpu else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    args.trainer_dtype = args.trainer_dtype or args.dtype
    args.servers = args.servers or (1 if args.gpu else 2)
    args.updates = args.updates or (2 if args.smoke else 5)
    if args.gpu:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        need = args.train_nproc + args.servers
        if torch.cuda.device_count() < need:
            ap.error(f"--gpu with --train-nproc {args.train_nproc} and --servers {args.servers} needs {need} GPUs, "
                     f"this machine has {torch.cuda.device_count()}")
    variants = [(float(b), d) for d in args.trainer_dtype.split(",") for b in args.bucket_mb.split(",")]
    rows = []
    for mode in args.modes.split(","):
        for (bucket_mb, trainer_dtype), k in [(v, k) for v in variants for k in (senders if mode == "collective" else [1])]:
            row = run_mode(argparse.Namespace(**{**vars(args), "bucket_mb": bucket_mb, "trainer_dtype": trainer_dtype,
                                                 "senders": k}), mode)
            short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(trainer_dtype, trainer_dtype)
            row["mode"] = " ".join([mode] + ([f"{bucket_mb:g}M {short}"] if len(variants) > 1 else [])
                                   + ([f"s{k}"] if len(senders) > 1 and mode == "collective" else []))
            rows.append(row)
            print(f"[{row['mode']}] update {row['update_s']:.4f} s, floor {row['floor_s']:.4f} s, "
                  f"ratio {row['ratio']:.2f}, bit-identical {row['bit_identical']}", flush=True)
    where = (f"{args.train_nproc + args.servers}x GPU, NCCL" if args.gpu else "CPU, gloo") + \
        f", {args.train_nproc} trainer rank(s), {args.servers} server(s)"
    print(f"\nweight sync, model {args.model} ({rows[0]['bytes'] / 2**30:.2f} GiB), {where}, "
          f"median of {args.updates} updates")
    print(f"{'mode':<22}{'update s':>10}{'floor s':>10}{'ratio':>8}{'trainer blocked s':>19}{'load s':>9}"
          f"{'GB/s':>8}{'staged/rank':>13}  bit-identical")
    for r in rows:
        print(f"{r['mode']:<22}{r['update_s']:>10.4f}{r['floor_s']:>10.4f}{r['ratio']:>8.2f}"
              f"{r['publish_blocks_s']:>19.4f}{r['load_s']:>9.4f}{r['bytes'] / r['update_s'] / 1e9:>8.2f}"
              f"{r['staged_share']:>13.2f}  {r['bit_identical']}")
    for r in rows:
        if r["timeline_s"]:
            print(f"{r['mode']} timeline, ms after the trainer's weights are ready (median):")
            for k, t in r["timeline_s"].items():
                print(f"  {k:<22}{t * 1e3:>9.2f}")
            print(f"{r['mode']} phases, ms after the trainer's weights are ready (median), in order:")
            for k, t in sorted(r["phases_s"].items(), key=lambda kv: kv[1]):
                print(f"  {k:<32}{t * 1e3:>9.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
