"""A client of Mooncake's distributed store, shared by rl-cache and the engines' connector.

Mooncake (``pip install 'rlcli[mooncake]'``: the ``mooncake-transfer-engine-non-cuda``
wheel, with Debian's ``libibverbs1`` on CPU machines; ``mooncake-transfer-engine`` with
CUDA) pools memory segments that clients mount; a master tracks where each object lives,
and payloads move between clients through its transfer engine (TCP here, RDMA where
configured). rl-cache mounts the pool's capacity; engines mount nothing and only move
blocks in and out. Batches are split so each fits the client's local transfer buffer.
"""

from rlcli.errors import ConfigError

BUFFER_BYTES = 64 << 20
"""Local transfer buffer of a client: the most payload bytes one batched call moves."""


def pool_key(key: bytes) -> str:
    """The Mooncake object name of a block key."""
    return "rlkv-" + key.hex()


class MooncakePool:
    """One ``MooncakeDistributedStore`` client (a segment of ``segment_bytes`` mounted into the pool)."""

    def __init__(self, *, host: str, master: str, metadata_server: str, segment_bytes: int = 0,
                 buffer_bytes: int = BUFFER_BYTES, protocol: str = "tcp", device_names: str = ""):
        try:
            from mooncake.store import MooncakeDistributedStore
        except (ImportError, OSError) as e:
            raise ConfigError(f"the mooncake backend needs Mooncake, which does not import here ({e}); "
                              "pip install 'rlcli[mooncake]' (and apt-get install libibverbs1), "
                              "or use cache.backend.name = \"memory\"") from None
        self.buffer_bytes = buffer_bytes
        self.client = MooncakeDistributedStore()
        rc = self.client.setup(host, metadata_server, segment_bytes, buffer_bytes, protocol, device_names, master)
        if rc != 0:
            raise ConfigError(f"could not join the Mooncake pool of master {master} (metadata {metadata_server}): "
                              f"setup returned {rc}; check cache.backend.master")

    def _batches(self, sizes: list[int]):
        start, total = 0, 0
        for i, n in enumerate(sizes):
            if i > start and total + n > self.buffer_bytes:
                yield start, i
                start, total = i, 0
            total += n
        if start < len(sizes):
            yield start, len(sizes)

    def put(self, keys: list[bytes], values: list) -> bool:
        """Store payloads (bytes or byte-typed memoryviews); False if Mooncake refused a batch."""
        names = [pool_key(k) for k in keys]
        ok = True
        for a, b in self._batches([len(v) for v in values]):
            ok &= self.client.put_batch(names[a:b], values[a:b]) == 0
        return ok

    def get(self, keys: list[bytes], sizes: list[int]) -> list[bytes | None]:
        """Payloads of ``keys`` (expected ``sizes``); None where absent or of another size."""
        names = [pool_key(k) for k in keys]
        out: list[bytes | None] = []
        for a, b in self._batches(sizes):
            for value, size in zip(self.client.get_batch(names[a:b]), sizes[a:b]):
                out.append(value if len(value) == size else None)
        return out

    def exists(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        return [r == 1 for r in self.client.batch_is_exist([pool_key(k) for k in keys])]

    def remove(self, key: bytes) -> None:
        self.client.remove(pool_key(key), True)

    def close(self) -> None:
        self.client.close()
