"""rl-cache's shared-memory arena: bit-exact slots, leases under capacity pressure, expiry,
reservations, size classes, the disk tier under it, and a real store serving a connector."""

import time

import numpy as np
import pytest
import torch
from kvstore import start_cache

from rlcli.cache.arena import ArenaStore
from rlcli.cache.client import CacheClient
from rlcli.cache.disk import TieredStore
from rlcli.cache.server import CacheService
from rlcli.config.infer import KVCacheConfig
from rlcli.errors import PeerUnreachable
from rlcli.infer.arena_connector import ArenaConnector, runs_of
from rlcli.infer.kv_connector import make_kv_connector
from rlcli.protocol import (
    BlockMeta, CacheGet, CacheGetReply, CachePut, CacheRelease, CacheReply, CacheReserve, CacheReserveReply,
    ErrorReply,
)
from rlcli.transport import shm
from rlcli.transport.zmq import RpcClient

META = BlockMeta(fingerprint="model-a", dtype="float32", shape=[2, 16, 8])  # 1 KiB blocks
N = META.nbytes


def blocks(n: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    return ([f"k{seed}-{i}".encode() for i in range(n)],
            [rng.standard_normal(META.shape).astype(np.float32).tobytes() for _ in range(n)])


@pytest.fixture
def arena():
    store = ArenaStore(4096, lease_s=60.0)  # one 4 KiB unit: four 1 KiB slots
    yield store
    name = store.name
    store.close()
    assert not shm.arena_path_of(name).exists()  # the arena file goes with the store


def test_blocks_round_trip_bit_exact_and_leases_name_their_slots(arena):
    keys, values = blocks(3)
    assert arena.put(keys, values, META) == 3
    assert arena.get(keys + [b"nope"], META) == values + [None]
    lease, offsets = arena.lease([keys[1], b"nope", keys[2]], META, prefix=True)
    assert lease and offsets[1:] == [None, None]  # the run stops at the miss
    mapped = shm.Mapping(arena.name)  # as an engine maps it
    assert mapped.array[offsets[0]:offsets[0] + N].tobytes() == values[1]
    mapped.close()
    assert arena.lease(keys[:1], BlockMeta(fingerprint="model-b", dtype="float32", shape=[2, 16, 8]))[0] == 0
    assert arena.stats()["rejected"] == 1 and arena.release(lease) and not arena.release(lease)


def test_a_leased_slot_is_never_overwritten_under_capacity_pressure(arena):
    keys, values = blocks(4)
    arena.put(keys, values, META)
    lease, offsets = arena.lease(keys[:2], META)
    new_keys, new_values = blocks(4, seed=1)
    assert arena.put(new_keys, new_values, META) == 4  # each evicts the oldest block nobody leases
    assert arena.exists(keys + new_keys) == [True, True, False, False, False, False, True, True]
    s = arena.stats()
    assert s["evictions"] == 4 and s["leased"] == 2 and s["bytes_used"] == 4 * N
    assert [arena.view(o, N).tobytes() for o in offsets] == values[:2]
    other, _ = arena.lease(new_keys[2:], META)  # now every slot is leased
    assert arena.reserve([b"r"], META) == (0, [-2])  # refused, not waited for
    assert arena.put([b"r"], [new_values[0]], META) == 0 and arena.stats()["refused"] == 2
    assert arena.prune() == (4, 4 * N)  # blocks gone, slots still leased: not reused
    assert arena.put([b"r"], [new_values[0]], META) == 0
    assert [arena.view(o, N).tobytes() for o in offsets] == values[:2]
    arena.release(lease)
    arena.release(other)
    assert arena.put(new_keys, new_values, META) == 4
    assert arena.get(new_keys, META) == new_values and arena.stats()["leased"] == 0


def test_leases_and_reservations_expire(arena):
    arena.lease_s = 0.05
    keys, values = blocks(4)
    arena.put(keys, values, META)
    arena.lease(keys, META)
    res, _ = arena.reserve([b"x"], META)  # every slot leased: refused
    assert res == 0 and arena.stats()["leased"] == 4
    time.sleep(0.1)
    res, slots = arena.reserve([keys[3], b"x"], META)  # the expired leases are taken back
    assert res and slots[0] == -1 and slots[1] >= 0  # (a key held is skipped)
    assert arena.exists(keys) == [False, True, True, True]  # the least recent one made room
    assert arena.exists([b"x"]) == [True]  # being written counts as present
    time.sleep(0.1)
    assert arena.expire() == 1 and arena.exists([b"x"]) == [False] and arena.stats()["leased"] == 0
    with pytest.raises(ValueError):
        arena.commit(res, [b"x"])  # expired


def test_reserve_write_commit_and_size_classes():
    store = ArenaStore(16 * 4096)  # sixteen 4 KiB units
    keys, values = blocks(5)
    res, offsets = store.reserve(keys, META)
    assert offsets == sorted(offsets) and runs_of(list(range(5)), offsets, N) == [(0, 5, offsets[0])]
    for o, v in zip(offsets, values):
        store.view(o, N)[:] = np.frombuffer(v, dtype=np.uint8)
    with pytest.raises(ValueError):
        store.commit(res, keys[:2])  # other keys than reserved: refused, slots freed
    assert store.exists(keys) == [False] * 5
    res, offsets = store.reserve(keys, META)
    for o, v in zip(offsets, values):
        store.view(o, N)[:] = np.frombuffer(v, dtype=np.uint8)
    assert store.commit(res, keys) == 5 and store.get(keys, META) == values
    big = BlockMeta(fingerprint="m", dtype="uint8", shape=[6000])  # 2 units per slab
    assert store.put([b"big"], [b"\x07" * 6000], big) == 1
    assert store.get([b"big"], big) == [b"\x07" * 6000] and store.get(keys, META) == values
    units_before = sum(u is None for u in store.units)
    assert store.prune("m") == (1, 6000) and sum(u is None for u in store.units) == units_before + 2
    store.close()


def test_eviction_spills_to_disk_and_leases_promote_disk_hits(tmp_path):
    keys, values = blocks(6)
    store = TieredStore(4096, tmp_path, 100 * N, arena=True)
    assert store.arena is not None and store.put(keys, values, META) == 6
    s = store.stats()
    assert s["ram_bytes"] == 4 * N and s["disk_blocks"] == 2  # the two oldest were spilled
    lease, offsets = store.lease(keys[:2], META, prefix=True)  # from disk, into slots
    assert [store.arena.view(o, N).tobytes() for o in offsets] == values[:2]
    store.release(lease)
    res, slots = store.reserve(keys[:1] + [b"new"], META)
    assert slots[0] == -1 and slots[1] >= 0  # held (in RAM or on disk): skipped
    store.release(res)
    store.close()  # RAM goes down to disk
    assert TieredStore(4096, tmp_path, 100 * N).get(keys, META) == values


def test_malformed_arena_requests_are_refused_and_the_store_keeps_serving(arena):
    keys, values = blocks(2)
    service = CacheService(arena)
    assert service.handle(CachePut(keys=keys, values=values, meta=META), "r").num_stored == 2
    for bad in [CacheGet(keys=keys, transfer="arena"),  # no meta
                CachePut(keys=keys, meta=META, lease=12345),  # no such reservation
                CachePut(keys=keys, values=values, meta=META, lease=1)]:
        with pytest.raises(ValueError):
            service.handle(bad, "r")
    assert service.handle(CacheRelease(lease=777), "r").num_stored == 0
    reply = service.handle(CacheGet(keys=keys, meta=META, transfer="arena", prefix=True), "r")
    assert reply.found == [True, True] and reply.arena == arena.name and reply.lease
    assert [arena.view(o, N).tobytes() for o in reply.offsets] == values
    assert service.handle(CacheRelease(lease=reply.lease), "r").num_stored == 1
    into = CacheGet(keys=keys, meta=META, transfer="shm", into=arena.name)  # "write into the arena"
    with pytest.raises(ValueError):
        service.handle(into, "r")
    assert arena.get(keys, META) == values and not arena.pins
    for name in ("../../etc/passwd", "rlcli-kv-" + "0" * 32, "rlcli-arena-" + "0" * 32):  # not an arena; stale
        with pytest.raises(ValueError):
            shm.Mapping(name)


def test_an_arena_left_by_a_killed_store_is_removed_by_the_next(arena):
    stale = shm.SHM_DIR / ("rlcli-arena-" + "1" * 32)  # no live owner holds its lock
    stale.write_bytes(b"\0" * 4096)
    second = ArenaStore(4096)
    assert not stale.exists() and shm.arena_path_of(arena.name).exists()  # the live one stays
    second.close()


def test_a_store_without_arena_refuses_arena_requests():
    from rlcli.cache.store import MemoryStore

    service = CacheService(MemoryStore(1 << 20))
    for bad in [CacheGet(keys=[b"k"], meta=META, transfer="arena"), CacheReserve(keys=[b"k"], meta=META),
                CacheRelease(lease=1)]:
        with pytest.raises(ValueError, match="arena"):
            service.handle(bad, "r")


def test_connector_round_trips_through_a_real_store(tmp_path):
    proc, endpoint = start_cache(tmp_path)
    try:
        conn = make_kv_connector(KVCacheConfig(endpoint=endpoint, transfer="arena"), META)
        assert isinstance(conn, ArenaConnector)
        rows = torch.randn(40, *META.shape).view(torch.uint8).reshape(40, N)
        keys = [f"c{i}".encode() for i in range(40)]
        assert conn.publish(keys[:30], rows[:30]) and conn.flush(30)
        assert conn.publish(keys, rows) and conn.flush(30)  # the first 30 are skipped
        s = conn.stats()
        assert s["kv_published_blocks"] == 40 and s["kv_publish_skipped"] == 30 and s["kv_publish_errors"] == 0
        ticket = conn.fetch_async(keys + [b"nope"])
        ticket.event.wait(30)
        data = ticket.take()  # a view of the leased slots (one run), until released
        assert torch.equal(data, rows) and ticket.on_release is not None
        ticket.release()
        assert torch.equal(conn.fetch(keys[5:9]), rows[5:9])
        with pytest.raises(PeerUnreachable):
            conn._runs(conn.mapping.name, [0], [conn.slots.numel()])  # a slot past the arena's end
        raw = RpcClient(endpoint)
        raw.sock.send(b"\x93\xff\x00garbage")
        assert isinstance(raw.call(CachePut(request_id="p", keys=keys, meta=META, lease=99), 10, "rl-cache"),
                          ErrorReply)
        assert isinstance(raw.call(CacheRelease(request_id="r", lease=99), 10, "rl-cache"), CacheReply)
        reserve = raw.call(CacheReserve(request_id="v", keys=[b"huge"], meta=BlockMeta(
            fingerprint="x", dtype="uint8", shape=[1 << 30])), 10, "rl-cache")
        assert isinstance(reserve, CacheReserveReply) and reserve.offsets == [-2]
        reply = raw.call(CacheGet(request_id="g", keys=keys[:3], meta=META, transfer="arena"), 10, "rl-cache")
        assert isinstance(reply, CacheGetReply) and reply.found == [True] * 3
        raw.call(CacheRelease(request_id="r2", lease=reply.lease), 10, "rl-cache")
        raw.close()
        client = CacheClient(endpoint)
        deadline = time.monotonic() + 10
        while (stats := client.stats())["leased"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the ticket's release is sent by the fetch thread
        client.close()
        assert stats["leased"] == 0 and stats["refused"] == 1 and stats["arena"] == conn.mapping.name
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
