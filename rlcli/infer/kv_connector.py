"""The ``KVConnector`` seam: an engine's link to a shared KV-block store (rl-cache).

Before prefill, an engine that misses a prefix locally asks the store for the longest
run of the prompt's next blocks (:meth:`KVConnector.fetch_async`): a background fetch
thread (one for fetches of up to ``kv_transfer.EXPRESS_BYTES``, another for larger ones, so
a small fetch never queues behind a large transfer) sends one store request for the whole run,
whose bytes land in host memory the device can read directly (a memory store on this
host writes them into the engine's /dev/shm mailbox, registered with CUDA; otherwise
pinned staging memory), copies them to the device on its own CUDA stream and marks the
:class:`FetchTicket` done. The engine keeps stepping its other requests meanwhile and
admits the waiting one once its ticket is done (:meth:`FetchTicket.take` hands the
payloads over to the engine's stream). After prefill, and when a completion finishes,
the engine hands the new full blocks (gathered on the device) to
:meth:`KVConnector.publish`, which only records an event and enqueues them: a publishing
thread copies them out on its own CUDA stream into pinned memory (never queued behind,
or blocking, the engine's stream) and moves them to the store with its own socket, so
publishing never delays a decode step; when the bounded queue is full a batch is dropped
(and counted), never waited for. ``flush`` waits for what was queued (a prefill server
answers only once its blocks are stored, so the decode server finds them).

Keys are the engine's chain hashes (cache salt, weights version, tokens); every request
carries the engine's :class:`BlockMeta` (model fingerprint, dtype, shape), so a store
never hands back another model's KV. ZeroMQ carries keys and layouts; payloads move
through the store backend's path: the store's shared arena for a memory store on this host
(``rlcli.infer.arena_connector``: one copy each way, none in the store), else /dev/shm
mailboxes (``transfer = "shm"``) or inline in the message (another host), Mooncake's transfer
engine for a mooncake store.
:func:`make_kv_connector` asks the store which backend it runs and builds the connector.

Here: the seam (:class:`KVConnector`, :class:`FetchTicket`) and the factory. The fetch lanes and
the publishing thread shared by every connector are ``rlcli.infer.kv_transfer``; the connectors
are ``rlcli.infer.store_connector`` (bytes through /dev/shm mailboxes or inline, Mooncake) and
``rlcli.infer.arena_connector``.
"""

import socket
import threading
from typing import Protocol

import torch

from rlcli.config.infer import KVCacheConfig
from rlcli.errors import ConfigError, PeerUnreachable
from rlcli.logging import setup_logging
from rlcli.protocol import BlockMeta, CacheStats, CacheStatsRequest
from rlcli.transport import shm
from rlcli.transport.zmq import RpcClient, new_request_id

log = setup_logging("rl-infer")


class KVConnector(Protocol):
    meta: BlockMeta
    """Layout of this engine's blocks; the fingerprint changes with the weights."""
    fetch_bytes_per_s: float
    """Speed of recent large fetches (request to payloads on the device), to predict a fetch's time."""
    timeout_s: float
    """Deadline of each store request (``infer.kv_cache.timeout_s``)."""

    def fetch_async(self, keys: list[bytes]) -> "FetchTicket":
        """Start fetching the longest leading run of ``keys`` the store holds (in the background;
        fetches are served in the order they were asked for)."""
        ...

    def fetch(self, keys: list[bytes]) -> torch.Tensor:
        """:meth:`fetch_async`, waiting for it: its ticket's :meth:`~FetchTicket.take`."""
        ...

    def publish(self, keys: list[bytes], payload: torch.Tensor) -> bool:
        """Queue blocks for the store (``payload``: a ``[len(keys), meta.nbytes]`` uint8 tensor,
        on any device, computed on the caller's current stream); False when the queue is full
        and the batch was dropped."""
        ...

    def publish_room(self) -> int:
        """Payload bytes :meth:`publish` would take now without dropping them."""
        ...

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued batch is stored; False on timeout."""
        ...

    def stats(self) -> dict[str, float]:
        ...

    def close(self) -> None:
        ...


def _call(client: RpcClient, msg, reply_type, timeout_s: float):
    reply = client.call(msg, timeout_s, peer="rl-cache")
    if not isinstance(reply, reply_type):
        raise PeerUnreachable(f"rl-cache answered {type(reply).__name__}: {getattr(reply, 'message', '')}")
    return reply


def _run_length(found: list[bool]) -> int:
    n = 0
    while n < len(found) and found[n]:
        n += 1
    return n


class FetchTicket:
    """One fetch in flight: its keys, then (``event`` set) the payloads of the leading run the store held."""

    def __init__(self, keys: list[bytes]):
        self.keys = keys
        self.event = threading.Event()
        self.data: torch.Tensor | None = None
        self.wait_s = 0.0  # time the store took to answer (queueing there included)
        self.on_release = None  # set when ``data`` is a view of store memory leased until :meth:`release`
        self.t_done = 0.0  # perf_counter when ``event`` was set

    def done(self) -> bool:
        return self.event.is_set()

    def take(self) -> torch.Tensor:
        """The payloads (once; the engine thread): ``[n, meta.nbytes]`` uint8 (n = 0 on a miss or
        an unreachable store), on the engine's device, ready for use on the caller's current stream."""
        assert self.done() and self.data is not None, "take() of a fetch in flight, or taken twice"
        data, self.data = self.data, None
        if data.is_cuda:  # made on the fetch stream: the caching allocator must not reuse it early
            data.record_stream(torch.cuda.current_stream(data.device))
        return data

    def release(self) -> None:
        """The taken payloads are copied (or dropped): memory the store leased for them may go."""
        release, self.on_release = self.on_release, None
        if release is not None:
            release()


def _is_local(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    if host in ("127.0.0.1", "localhost", "::1", socket.gethostname()):
        return True
    try:
        return socket.gethostbyname(host) == socket.gethostbyname(socket.gethostname())
    except OSError:
        return False


def make_kv_connector(cfg: KVCacheConfig, meta: BlockMeta, device: torch.device | None = None) -> KVConnector | None:
    """The connector for the store at ``cfg.endpoint`` (None when it is empty) of an engine on ``device``."""
    if not cfg.endpoint:
        return None
    if not cfg.endpoint.startswith("tcp://"):
        raise ConfigError(f"infer.kv_cache.endpoint must be tcp://host:port (--kv-cache), got {cfg.endpoint!r}")
    probe = RpcClient(cfg.endpoint)
    try:
        info = _call(probe, CacheStatsRequest(request_id=new_request_id()), CacheStats, cfg.timeout_s)
    except PeerUnreachable as e:
        raise PeerUnreachable(f"no rl-cache at --kv-cache {cfg.endpoint}: {e}") from None
    finally:
        probe.close()
    from rlcli.infer.store_connector import MooncakeConnector, StoreConnector

    conn: KVConnector | None = None
    local = _is_local(cfg.endpoint)
    if info.backend == "mooncake":
        conn = MooncakeConnector(cfg.endpoint, meta, cfg.publish_queue, cfg.timeout_s, info.mooncake_master,
                                 info.mooncake_metadata, device)
    elif info.arena and cfg.transfer in ("auto", "arena") and local:
        from rlcli.infer.arena_connector import ArenaConnector

        try:
            conn = ArenaConnector(cfg.endpoint, meta, cfg.publish_queue, cfg.timeout_s, info.arena, device)
        except ValueError as e:  # its /dev/shm is not this one (another container)
            log.warning("cannot map rl-cache's arena (%s): payloads through copies", e)
    if conn is None and cfg.transfer == "arena":
        raise ConfigError(f"infer.kv_cache.transfer is arena but rl-cache at {cfg.endpoint} has no arena this "
                          "process can map (same host, memory backend, room in /dev/shm): use auto")
    if conn is None:
        via_shm = cfg.transfer == "shm" or (cfg.transfer == "auto" and local and shm.available())
        conn = StoreConnector(cfg.endpoint, meta, cfg.publish_queue, cfg.timeout_s, via_shm, device)
    conn.queue_bytes = int(cfg.publish_queue_mb * 2**20)
    via = "mooncake" if info.backend == "mooncake" else getattr(conn, "via", "") or (
        "shm" if conn.via_shm else "zeromq")
    log.info("KV blocks shared through rl-cache at %s (%s backend, payloads via %s)", cfg.endpoint, info.backend, via)
    return conn
