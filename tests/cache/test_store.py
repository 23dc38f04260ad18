import subprocess
import sys
import time

import pytest

from rlcli.cache.client import CacheClient
from rlcli.cache.store import MemoryStore
from rlcli.transport.registry import list_entries


def test_lru_eviction_by_bytes():
    store = MemoryStore(capacity_bytes=10)
    assert store.put([b"a", b"b"], [b"1234", b"5678"]) == 2
    assert store.get([b"a"]) == [b"1234"]  # a is now the most recent
    store.put([b"c"], [b"xyz0"])  # 12 bytes > 10: evicts b, the least recent
    assert store.exists([b"a", b"b", b"c"]) == [True, False, True]
    assert store.put([b"huge"], [b"x" * 11]) == 0  # larger than the whole store: refused
    s = store.stats()
    assert s["bytes_used"] == 8 and s["num_blocks"] == 2 and s["evictions"] == 1 and s["hits"] == 1
    assert store.get([b"zz"]) == [None] and store.stats()["misses"] == 1


def test_put_replaces_and_counts_bytes_once():
    store = MemoryStore(capacity_bytes=100)
    store.put([b"k"], [b"12345"])
    store.put([b"k"], [b"12"])
    assert store.stats()["bytes_used"] == 2


def test_mismatched_put_is_an_error():
    with pytest.raises(ValueError):
        MemoryStore(10).put([b"a"], [])


def test_serve_and_stats_commands(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rlcli.cli.cache", "serve", "--run-dir", str(run_dir),
                             "--capacity-mb", "1"], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(200):
            entries = list_entries(run_dir / "registry", "cache")
            if entries:
                break
            time.sleep(0.05)
        assert entries, proc.stderr.read() if proc.poll() is not None else "rl-cache did not register"
        client = CacheClient(entries[0].endpoints["rpc"])
        assert client.put([b"k1", b"k2"], [b"v" * 100, b"w" * 200]) == 2
        assert client.get([b"k1", b"nope"]) == [b"v" * 100, None]
        assert client.exists([b"k2", b"nope"]) == [True, False]
        client.close()
        out = subprocess.run([sys.executable, "-m", "rlcli.cli.cache", "stats", "--run-dir", str(run_dir),
                              "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        import json

        stats = json.loads(out.stdout)
        assert stats["num_blocks"] == 2 and stats["bytes_used"] == 300 and stats["hits"] == 1
        assert stats["capacity_bytes"] == 2**20
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0
    assert list_entries(run_dir / "registry", "cache") == []  # deregistered on exit
