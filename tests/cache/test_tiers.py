"""rl-cache's tiers: bit-exact round trips, layout checks, capacity, checksums, malformed requests."""

import subprocess
import sys
import time

import numpy as np
import pytest

from rlcli.cache.client import CacheClient
from rlcli.cache.disk import DiskStore, TieredStore
from rlcli.cache.server import CacheService
from rlcli.cache.store import MemoryStore
from rlcli.infer.block_manager import chain_hash
from rlcli.protocol import BlockMeta, CacheExists, CacheGet, CacheGetReply, CachePut, ErrorReply
from rlcli.transport import shm
from rlcli.transport.registry import list_entries
from rlcli.transport.zmq import RpcClient

META = BlockMeta(fingerprint="model-a", dtype="float32", shape=[2, 16, 8])
OTHER = BlockMeta(fingerprint="model-b", dtype="float32", shape=[2, 16, 8])


def blocks(n: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(META.shape).astype(np.float32).tobytes() for _ in range(n)]
    keys = [chain_hash(None, f"s|w{seed}", [i]) for i in range(n)]
    return keys, values


def test_ram_and_disk_round_trip_bit_exact(tmp_path):
    keys, values = blocks(6)
    store = TieredStore(2 * META.nbytes, tmp_path / "disk", 100 * META.nbytes)
    assert store.put(keys, values, META) == 6
    s = store.stats()
    assert s["ram_bytes"] == 2 * META.nbytes and s["disk_blocks"] == 4  # four spilled to disk
    assert store.get(keys, META) == values  # from disk (checksummed) and RAM, bit for bit
    store.close()
    reopened = TieredStore(2 * META.nbytes, tmp_path / "disk", 100 * META.nbytes)  # a restarted store
    assert reopened.get(keys, META, prefix=True) == values


def test_corrupt_disk_block_is_dropped_not_served(tmp_path):
    keys, values = blocks(3)
    disk = DiskStore(tmp_path, 10 * META.nbytes)
    for k, v in zip(keys, values):
        disk.write(k, v, META)
    path = disk._path(keys[1])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40  # one flipped bit in the payload
    path.write_bytes(bytes(raw))
    disk.close()  # the writer's store has gone (it held the directory)
    store = TieredStore(META.nbytes, tmp_path, 10 * META.nbytes)
    assert store.get(keys, META) == [values[0], None, values[2]]
    assert store.stats()["corrupt"] == 1 and not path.exists()
    assert store.get(keys, META, prefix=True) == [values[0], None, None]  # the run stops at the hole


def test_a_disk_directory_serves_one_store_at_a_time(tmp_path):
    """Each store indexes and evicts the directory's files as its own: a second live store on it is
    refused naming --disk-dir; once the first has closed (or died), the directory is free."""
    from rlcli.errors import ConfigError

    keys, values = blocks(2)
    first = TieredStore(META.nbytes, tmp_path, 10 * META.nbytes)
    first.put(keys, values, META)
    with pytest.raises(ConfigError, match="--disk-dir"):
        DiskStore(tmp_path, 10 * META.nbytes)
    first.close()  # the RAM tier goes down to disk, the lock is released
    again = DiskStore(tmp_path, 10 * META.nbytes)
    assert set(again.index) == set(keys)
    again.close()


def test_eviction_respects_capacity(tmp_path):
    keys, values = blocks(20)
    ram = MemoryStore(3 * META.nbytes + 7)
    tiered = TieredStore(2 * META.nbytes, tmp_path, 5 * META.nbytes)
    for k, v in zip(keys, values):
        ram.put([k], [v], META)
        tiered.put([k], [v], META)
        assert ram.stats()["bytes_used"] <= 3 * META.nbytes + 7
        s = tiered.stats()
        assert s["ram_bytes"] <= 2 * META.nbytes and s["disk_bytes"] <= 5 * META.nbytes
    assert ram.exists(keys) == [False] * 17 + [True] * 3  # the newest stay
    assert tiered.exists(keys) == [False] * 13 + [True] * 7
    assert sum(1 for f in (tmp_path).glob("*/*.kv")) == 5
    assert tiered.stats()["evictions"] == 18 + 13  # 18 left RAM, 13 of them then left disk


def test_layout_mismatch_is_refused_and_never_served():
    keys, values = blocks(2)
    store = MemoryStore(1 << 20)
    assert store.put(keys, [values[0], values[1][:-4]], META) == 1  # wrong size: refused
    assert store.get(keys[:1], OTHER) == [None]  # another model's layout: a miss
    assert store.get(keys[:1], BlockMeta(fingerprint="model-a", dtype="bfloat16", shape=[2, 16, 16])) == [None]
    assert store.get(keys[:1], META) == [values[0]]
    assert store.stats()["rejected"] == 3


def test_salts_and_versions_never_collide():
    tokens = list(range(16))
    salts = ["", "0|w0", "0|w1", "1|w0", "1|w0-w1", "0", "w0"]
    keys = {chain_hash(None, s, tokens) for s in salts}
    assert len(keys) == len(salts)
    chained = {chain_hash(chain_hash(None, s, tokens), s, tokens) for s in salts}
    assert len(chained) == len(salts) and not chained & keys
    store = MemoryStore(1 << 20)
    store.put([chain_hash(None, "0|w0", tokens)], [b"x" * META.nbytes], META)
    assert store.get([chain_hash(None, s, tokens) for s in salts if s != "0|w0"], META) == [None] * (len(salts) - 1)


def test_service_survives_malformed_requests(tmp_path):
    keys, values = blocks(2)
    service = CacheService(MemoryStore(1 << 20))
    bad = [CachePut(keys=keys, values=values[:1]),
           CachePut(keys=keys, meta=META, shm="../../etc/passwd"),
           CachePut(keys=keys, meta=META, shm="rlcli-kv-" + "0" * 32),  # no such file
           CachePut(keys=keys, shm="rlcli-kv-" + "1" * 32),  # no meta
           CachePut(keys=keys, meta=META, mooncake=True),  # not a mooncake store
           CacheGet(keys=keys, transfer="carrier-pigeon"), CacheGet(keys=keys, transfer="shm")]
    for msg in bad:
        with pytest.raises(ValueError):
            service.handle(msg, "r")
    name = shm.write_payloads([values[0], values[1][:-1]])  # one byte short
    with pytest.raises(ValueError):
        service.handle(CachePut(keys=keys, meta=META, shm=name), "r")
    shm.remove(name)
    assert service.handle(CachePut(keys=keys, values=values, meta=META), "r").num_stored == 2
    reply = service.handle(CacheGet(keys=[keys[1], b"nope", keys[0]], meta=META, transfer="shm"), "r")
    assert reply.found == [True, False, True]
    assert shm.read_payloads(reply.shm, META.nbytes, 2) == [values[1], values[0]]
    service.sweep(0.0)  # never collected: removed
    assert not shm.path_of(reply.shm).exists()


def test_gets_and_puts_through_mailboxes_round_trip_bit_exact():
    """A requester's reused /dev/shm files: the store writes a found run into the fetch one and
    reads a put from the publish one (larger than the payload); a mailbox too small is refused."""
    keys, values = blocks(3)
    service = CacheService(MemoryStore(1 << 20))
    put_box, get_box = shm.Mailbox(), shm.Mailbox()
    put_box.view(5 * META.nbytes)[:3 * META.nbytes] = np.frombuffer(b"".join(values), dtype=np.uint8)
    assert service.handle(CachePut(keys=keys, meta=META, shm=put_box.name), "r").num_stored == 3
    fetched = get_box.view(4 * META.nbytes)  # mapped (and sized) before the request, as a connector does
    reply = service.handle(CacheGet(keys=[*keys[:2], b"nope", keys[2]], meta=META, transfer="shm", prefix=True,
                                    into=get_box.name), "r")
    assert reply.found == [True, True, False, False] and reply.shm == get_box.name
    assert fetched[:2 * META.nbytes].tobytes() == values[0] + values[1]
    small = shm.Mailbox()
    small.view(META.nbytes)
    with pytest.raises(ValueError):
        service.handle(CacheGet(keys=keys, meta=META, transfer="shm", into=small.name), "r")
    names = [b.name for b in (put_box, get_box, small)]
    for box in (put_box, get_box, small):
        box.close()
    assert not any(shm.path_of(n).exists() for n in names)


def test_parallel_copy_into_a_mailbox_is_bit_exact(monkeypatch):
    _, values = blocks(7)
    box = shm.Mailbox()
    view = box.view(8 * META.nbytes)
    monkeypatch.setattr(shm, "PARALLEL_BYTES", META.nbytes)  # split these few small blocks over 3 threads
    shm.write_into(box.name, values, threads=3)
    assert view[:7 * META.nbytes].tobytes() == b"".join(values)
    box.close()


def test_serve_shm_ls_prune_commands(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rlcli.cli.cache", "serve", "--run-dir", str(run_dir),
                             "--capacity-mb", "1", "--disk-dir", str(tmp_path / "disk")],
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(200):
            if entries := list_entries(run_dir / "registry", "cache"):
                break
            time.sleep(0.05)
        assert entries, proc.stderr.read() if proc.poll() is not None else "rl-cache did not register"
        endpoint = entries[0].endpoints["rpc"]
        client = CacheClient(endpoint)
        keys, values = blocks(3)
        assert client.put(keys, values, META, via_shm=True) == 3
        assert client.get(keys + [b"nope"], META, via_shm=True) == values + [None]
        assert client.get(keys, OTHER, via_shm=True) == [None] * 3
        raw = RpcClient(endpoint)  # garbage on the socket, then a valid request still works
        raw.sock.send(b"\x93\xff\x00garbage")
        assert isinstance(raw.call(CacheGet(request_id="x", keys=keys[:1], meta=META), 10, "rl-cache"),
                          CacheGetReply)
        assert isinstance(raw.call(CachePut(request_id="y", keys=keys, values=[b""], meta=META), 10, "rl-cache"),
                          ErrorReply)
        raw.close()
        client.close()
        import json

        def cli(*args):
            out = subprocess.run([sys.executable, "-m", "rlcli.cli.cache", *args, "--connect", endpoint, "--json"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return [json.loads(line) for line in out.stdout.splitlines()]

        (stats,) = cli("stats")
        assert stats["hits"] == 4 and stats["misses"] == 4 and stats["rejected"] == 3 and stats["num_blocks"] == 3
        assert stats["ram_bytes"] == 3 * META.nbytes and 0 < stats["hit_rate"] < 1
        listed = cli("ls")
        assert sorted(e["key"] for e in listed) == sorted(k.hex() for k in keys)
        assert listed[0]["meta"] == {"fingerprint": "model-a", "dtype": "float32", "shape": [2, 16, 8]}
        assert cli("prune", "--fingerprint", "model-b") == [{"num_removed": 0, "bytes_freed": 0}]
        assert cli("prune") == [{"num_removed": 3, "bytes_freed": 3 * META.nbytes}]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0


def test_a_put_being_copied_holds_up_no_lookup():
    """A put through /dev/shm is split into its lookup part (socket thread) and its copy (a
    worker): while the copy has not run, its keys count as present for ``exists`` (another
    publisher skips them), gets of them are misses answered at once, and other blocks are
    served; once it has run they are stored bit for bit."""
    keys, values = blocks(3)
    service = CacheService(MemoryStore(1 << 20))
    assert service.handle(CachePut(keys=keys[:1], values=values[:1], meta=META), "r").num_stored == 1
    box, into = shm.Mailbox(), shm.Mailbox()
    box.view(2 * META.nbytes)[:] = np.frombuffer(b"".join(values[1:]), dtype=np.uint8)
    into.view(3 * META.nbytes)
    copy = service.begin(CachePut(keys=keys[1:], meta=META, shm=box.name), "put")
    assert callable(copy) and copy.nbytes == 2 * META.nbytes
    assert service.handle(CacheExists(keys=keys), "e").exists == [True, True, True]
    miss = service.begin(CacheGet(keys=keys[1:], meta=META, transfer="shm", prefix=True, into=into.name), "m")
    assert isinstance(miss, CacheGetReply) and miss.found == [False, False] and miss.shm == ""
    assert copy().num_stored == 2
    assert service.handle(CacheExists(keys=keys + [b"nope"]), "e").exists == [True, True, True, False]
    reply = service.handle(CacheGet(keys=keys, meta=META, transfer="shm", prefix=True, into=into.name), "g")
    assert reply.found == [True] * 3 and into.view(3 * META.nbytes).tobytes() == b"".join(values)
    assert not service.pending
    box.close()
    into.close()


def test_parallel_copies_are_bit_exact(monkeypatch):
    """Large puts and gets are copied by several threads (on hosts with the cores): each
    thread's share lands where a single copy would put it."""
    monkeypatch.setattr(shm, "PARALLEL_BYTES", META.nbytes)  # every payload is "large" here
    keys, values = blocks(7)
    name = shm.write_payloads(values)
    assert shm.read_payloads(name, META.nbytes, 7, threads=3) == values
    assert shm.read_payloads(name, META.nbytes, 5, threads=4) == values[:5]
    shm.remove(name)
    box = shm.Mailbox()
    box.view(8 * META.nbytes)
    shm.write_into(box.name, values, threads=3)
    assert box.view(7 * META.nbytes).tobytes() == b"".join(values)
    box.close()
