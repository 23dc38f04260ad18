"""The connectors that move payload bytes themselves: rl-cache's memory store through /dev/shm
mailboxes or inline in the message (:class:`StoreConnector`), and rl-cache's Mooncake store
(:class:`MooncakeConnector`). The arena path (no copy in the store) is ``arena_connector``;
the seam and the factory are ``kv_connector``.
"""

import socket
import threading
from functools import partial

import numpy as np
import torch

from rlcli.errors import PeerUnreachable
from rlcli.infer.kv_connector import _call, _run_length
from rlcli.infer.kv_transfer import EXPRESS_BYTES, _Publisher, _register, _unregister
from rlcli.protocol import BlockMeta, CacheGet, CacheGetReply, CachePut, CacheReply
from rlcli.transport import shm
from rlcli.transport.zmq import RpcClient, new_request_id


class StoreConnector(_Publisher):
    """rl-cache's memory (RAM/disk) store; payloads through /dev/shm (``via_shm``) or inline.

    Through /dev/shm the engine keeps three :class:`~rlcli.transport.shm.Mailbox` files (one
    per fetch lane, the express one sized up front, and one to publish), registered with CUDA
    for a CUDA engine: the store writes a fetched run into the lane's mailbox (one copy), the
    device reads it from there; a published payload is copied from the device straight into
    the publish mailbox, the store reads it (one copy)."""

    def __init__(self, endpoint: str, meta: BlockMeta, queue_size: int, timeout_s: float, via_shm: bool,
                 device: torch.device | None = None):
        self.via_shm = self.reuses_fetch_buffer = via_shm
        if via_shm:
            self.max_fetch_bytes = 1 << 62  # one request per fetch or publish: only keys cross ZeroMQ
            cuda = device is not None and device.type == "cuda"
            hooks = (partial(_register, device), partial(_unregister, device)) if cuda else (None, None)
            self.fetch_boxes = [shm.Mailbox(*hooks), shm.Mailbox(*hooks)]  # one per fetch lane
            self.fetch_boxes[0].view(EXPRESS_BYTES)  # mapped (and registered) now, not on a first small fetch
            self.publish_box = shm.Mailbox(*hooks)
        super().__init__(endpoint, meta, queue_size, timeout_s, device)

    def _fetch(self, lane: int, client: RpcClient, keys: list[bytes]) -> torch.Tensor:
        nbytes = self.meta.nbytes
        box = self.fetch_boxes[lane] if self.via_shm else None
        into = box.view(len(keys) * nbytes) if self.via_shm else None
        msg = CacheGet(request_id=new_request_id(), keys=keys, meta=self.meta, prefix=True,
                       transfer="shm" if self.via_shm else "", into=box.name if self.via_shm else "")
        reply = _call(client, msg, CacheGetReply, self.timeout_s)
        n = _run_length(reply.found)
        if not self.via_shm:
            return self._rows(reply.values[:n])
        if n and reply.shm != box.name:
            raise PeerUnreachable("rl-cache did not write into this engine's /dev/shm mailbox")
        return torch.from_numpy(into[:n * nbytes]).view(n, nbytes)

    def _staging(self, num_blocks: int) -> torch.Tensor:
        if not self.via_shm:
            return self._host_buffer(num_blocks)
        nbytes = self.meta.nbytes
        return torch.from_numpy(self.publish_box.view(num_blocks * nbytes)).view(num_blocks, nbytes)

    def _store(self, client: RpcClient, keys: list[bytes], rows: torch.Tensor, idx: list[int],
               meta: BlockMeta) -> int:
        if not self.via_shm:
            values = [rows[i].numpy().tobytes() for i in idx]
            return _call(client, CachePut(request_id=new_request_id(), keys=keys, values=values, meta=meta),
                         CacheReply, self.timeout_s).num_stored
        box = self.publish_box.view(len(idx) * meta.nbytes).reshape(len(idx), meta.nbytes)
        src = rows.numpy()
        if not np.shares_memory(src, box):
            np.take(src, idx, axis=0, out=box, mode="clip")  # one copy, no temporary
        elif idx != list(range(len(idx))):  # else: already in place
            box[:] = src[idx]  # (fancy indexing copies first: overlap is safe)
        msg = CachePut(request_id=new_request_id(), keys=keys, meta=meta, shm=self.publish_box.name)
        return _call(client, msg, CacheReply, self.timeout_s).num_stored

    def close(self) -> None:
        super().close()
        if self.via_shm:
            for box in self.fetch_boxes:
                box.close()
            self.publish_box.close()


class MooncakeConnector(_Publisher):
    """rl-cache's mooncake store: this engine joins the pool as a client (mounting no memory);
    rl-cache answers which keys it holds, the payloads move through Mooncake."""

    def __init__(self, endpoint: str, meta: BlockMeta, queue_size: int, timeout_s: float, master: str,
                 metadata_server: str, device: torch.device | None = None):
        from rlcli.transport.mooncake import MooncakePool

        master_host = master.rpartition(":")[0]
        local = "127.0.0.1" if master_host in ("127.0.0.1", "localhost") else socket.gethostbyname(socket.gethostname())
        self.pool = MooncakePool(host=local, master=master, metadata_server=metadata_server)
        self.lock = threading.Lock()  # the fetch and publish threads share the pool client
        self.max_fetch_bytes = 1 << 62  # payloads move through Mooncake: one request per fetch
        super().__init__(endpoint, meta, queue_size, timeout_s, device)

    def _fetch(self, lane: int, client: RpcClient, keys: list[bytes]) -> torch.Tensor:
        msg = CacheGet(request_id=new_request_id(), keys=keys, meta=self.meta, prefix=True, transfer="mooncake")
        n = _run_length(_call(client, msg, CacheGetReply, self.timeout_s).found)
        with self.lock:
            values = self.pool.get(keys[:n], [self.meta.nbytes] * n)
        run = _run_length([v is not None for v in values])
        return self._rows(values[:run])

    def _store(self, client: RpcClient, keys: list[bytes], rows: torch.Tensor, idx: list[int],
               meta: BlockMeta) -> int:
        src = rows.numpy()
        with self.lock:
            if not self.pool.put(keys, [memoryview(src[i]) for i in idx]):
                raise PeerUnreachable("Mooncake refused the blocks (pool full?)")
        msg = CachePut(request_id=new_request_id(), keys=keys, meta=meta, mooncake=True)
        return _call(client, msg, CacheReply, self.timeout_s).num_stored

    def close(self) -> None:
        super().close()
        self.pool.close()
