"""rl-cache --backend mooncake for real: a mooncake_master started by rl-cache, the store and
two engines as clients of its pool over TCP on 127.0.0.1 (CI installs the
mooncake-transfer-engine-non-cuda wheel and libibverbs1)."""

import importlib.util

import numpy as np
import pytest
import torch
from kvstore import PREFIX, TAILS, engine, requests, run, start_cache

from rlcli.cache.client import CacheClient
from rlcli.protocol import BlockMeta

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                reason="Mooncake is not installed (pip install 'rlcli[mooncake]'; "
                                       "apt-get install libibverbs1)")


@pytest.fixture
def mooncake_cache(tmp_path):
    proc, endpoint = start_cache(tmp_path, "--backend", "mooncake")
    yield endpoint
    proc.terminate()
    proc.wait(timeout=30)


def test_blocks_round_trip_bit_exact_through_the_pool(mooncake_cache):
    meta = BlockMeta(fingerprint="m", dtype="bfloat16", shape=[4, 16, 32])
    rng = np.random.default_rng(0)
    keys = [bytes([i]) * 16 for i in range(5)]
    values = [rng.integers(0, 2**16, meta.nbytes // 2, dtype=np.uint16).tobytes() for _ in keys]
    client = CacheClient(mooncake_cache, timeout_s=30)
    stats = client.stats()
    assert stats["backend"] == "mooncake" and stats["mooncake_master"].startswith("127.0.0.1:")
    assert client.put(keys, values, meta) == 5
    assert client.get(keys + [b"x" * 16], meta) == values + [None]
    assert client.get(keys, BlockMeta(fingerprint="other", dtype="bfloat16", shape=[4, 16, 32])) == [None] * 5
    assert client.get([keys[0], b"x" * 16, keys[2]], meta, prefix=True) == [values[0], None, None]
    assert {e["key"] for e in client.ls()} == {k.hex() for k in keys}
    assert client.prune() == {"num_removed": 5, "bytes_freed": 5 * meta.nbytes}
    assert client.get(keys, meta) == [None] * 5
    client.close()


def test_engines_share_kv_through_mooncake(tiny_model_dir, mooncake_cache):
    from rlcli.infer.store_connector import MooncakeConnector
    from rlcli.models import load_model

    model = load_model(tiny_model_dir, seed=1)
    a, b = engine(model, mooncake_cache), engine(model, mooncake_cache)
    assert isinstance(a.kv, MooncakeConnector)
    out_a = run(a, requests(PREFIX, TAILS[:1]))
    assert a.kv.flush(30) and a.stats()["kv_published_blocks"] >= 10
    out_b = run(b, requests(PREFIX, TAILS[:1]))
    assert b.stats()["kv_fetched_blocks"] >= 10
    assert out_b["0"].completions[0].token_ids == out_a["0"].completions[0].token_ids
    hashes = b.blocks.block_hashes(PREFIX, "3|w0")
    assert torch.equal(a._gather_blocks([a.blocks.hash_to_block[h] for h in hashes]),
                       b._gather_blocks([b.blocks.hash_to_block[h] for h in hashes]))
    a.close()
    b.close()
