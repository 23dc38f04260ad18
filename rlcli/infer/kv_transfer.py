"""The background threads every :class:`~rlcli.infer.kv_connector.KVConnector` runs: two fetch
lanes and a publishing thread, each with its own socket (and, on a GPU, its own CUDA stream).

The connectors (``store_connector``, ``arena_connector``) subclass :class:`_Publisher` and
supply the store requests: :meth:`_Publisher._fetch` (or the whole :meth:`_Publisher._fetch_run`)
and :meth:`_Publisher._store` (or :meth:`_Publisher._publish_batch`). The rules (lanes, the
bounded publish queue that drops rather than waits) are in ``rlcli.infer.kv_connector``.
"""

import queue
import threading
import time

import numpy as np
import torch

from rlcli.errors import PeerUnreachable
from rlcli.infer.kv_connector import FetchTicket, _call, log
from rlcli.protocol import BlockMeta, CacheExists, CacheExistsReply
from rlcli.transport.zmq import RpcClient, new_request_id

BATCH_BYTES = 32 << 20
"""Most payload bytes in one store request (rl-cache refuses messages past 256 MiB)."""
QUEUE_BYTES = 2 << 30
"""Most payload bytes waiting to be published by default (``infer.kv_cache.publish_queue_mb``; they
hold device memory until copied out)."""
EXPRESS_BYTES = 64 << 20
"""Fetches asking for at most this many bytes take the express lane: a second fetch thread, so
they never queue behind a large transfer (each lane has its own socket, stream and mailbox)."""


def _cudart_call(device: torch.device, name: str, *args) -> bool:
    """A CUDA runtime call on a helper thread: a failure leaves its error code on that thread,
    never on the engine's (where the next kernel launch check would raise it)."""
    result = []

    def call() -> None:
        try:
            cudart = torch.cuda.cudart()
            with torch.cuda.device(device):
                result.append(getattr(cudart, name)(*args) == cudart.cudaError.success)
        except Exception:  # best effort: an unregistered mapping still works, staged
            result.append(False)

    t = threading.Thread(target=call, name=f"kv-{name}")
    t.start()
    t.join()
    return bool(result and result[0])


def _register(device: torch.device, array: np.ndarray) -> None:
    """Page-lock a host mapping for CUDA, so copies to and from the device read it directly
    (left pageable, with a warning, where the driver refuses: copies are then staged)."""
    if not _cudart_call(device, "cudaHostRegister", array.ctypes.data, array.nbytes, 1):  # 1: portable
        log.warning("could not register a %d-byte /dev/shm mapping with CUDA: KV copies are staged", array.nbytes)


def _unregister(device: torch.device, array: np.ndarray) -> None:
    _cudart_call(device, "cudaHostUnregister", array.ctypes.data)


class _Publisher:
    """The background fetch and publishing threads and the counters shared by both connectors."""

    reuses_fetch_buffer = False
    """Whether :meth:`_fetch` answers in memory the next fetch overwrites (copied out before then)."""

    max_fetch_bytes = BATCH_BYTES
    """Most payload bytes one fetch request asks for (payloads that do not cross ZeroMQ: no limit)."""

    def __init__(self, endpoint: str, meta: BlockMeta, queue_size: int, timeout_s: float,
                 device: torch.device | None = None):
        self.endpoint, self.meta, self.timeout_s = endpoint, meta, timeout_s
        self.device = device or torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        # The publisher's device-to-host copies run on this stream, beside the engine's.
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # Fetch lanes: 0 for fetches of up to EXPRESS_BYTES, 1 for larger ones.
        self.fetch_streams = [torch.cuda.Stream(self.device) if self.cuda else None for _ in range(2)]
        self.fetches: list[queue.Queue] = [queue.Queue(), queue.Queue()]
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.queued_bytes = 0  # payload bytes queued and not yet copied out
        self.queue_bytes = QUEUE_BYTES  # at most (make_kv_connector sets the config's)
        self.bytes_lock = threading.Lock()
        self.counters = {"kv_fetch_requests": 0, "kv_fetched_blocks": 0, "kv_fetched_bytes": 0, "kv_fetch_s": 0.0,
                         "kv_fetch_store_s": 0.0, "kv_fetch_errors": 0, "kv_published_blocks": 0,
                         "kv_published_bytes": 0,
                         "kv_publish_skipped": 0, "kv_publish_dropped": 0, "kv_publish_refused": 0,
                         "kv_publish_errors": 0, "kv_publish_s": 0.0}
        self.fetch_bytes_per_s = 4e9  # until measured
        self.thread = threading.Thread(target=self._work, name="kv-publish", daemon=True)
        self.thread.start()
        self.fetchers = [threading.Thread(target=self._fetch_work, args=(lane,), name=f"kv-fetch-{lane}",
                                          daemon=True) for lane in range(2)]
        for t in self.fetchers:
            t.start()

    def publish_room(self) -> int:
        """Payload bytes the publish queue takes now (0 when it holds its most batches)."""
        with self.bytes_lock:
            return 0 if self.queue.full() else max(self.queue_bytes - self.queued_bytes, 0)

    def publish(self, keys: list[bytes], payload: torch.Tensor) -> bool:
        if not keys:
            return True
        nbytes = payload.numel()
        ready = None
        if payload.is_cuda:  # the gather is queued on the engine's stream: the copy waits for it there
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(payload.device))
        with self.bytes_lock:
            try:
                if self.queued_bytes + nbytes > self.queue_bytes:
                    raise queue.Full
                # meta: the layout of the weights that computed them
                self.queue.put_nowait((list(keys), payload, ready, self.meta))
                self.queued_bytes += nbytes
                return True
            except queue.Full:
                self.counters["kv_publish_dropped"] += len(keys)
                return False

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.queue.all_tasks_done:
            while self.queue.unfinished_tasks:
                if not self.queue.all_tasks_done.wait(max(0.0, deadline - time.monotonic())):
                    return False
        return True

    def _work(self) -> None:
        client = RpcClient(self.endpoint)  # sockets are not shared between threads
        try:
            while (item := self.queue.get()) is not None:
                keys, batch = item[0], list(item)
                left = [item[1].numel()]  # queued bytes not yet copied out of the payload
                del item
                t0 = time.monotonic()
                try:
                    self._publish_batch(client, batch, left)
                except Exception as e:  # the store being down must not stop the engine
                    self.counters["kv_publish_errors"] += len(keys)
                    log.warning("could not publish %d KV blocks: %s", len(keys), e)
                finally:
                    batch.clear()
                    self._copied_out(left)
                    self.counters["kv_publish_s"] += time.monotonic() - t0
                    self.queue.task_done()
        finally:
            client.close()
            self.queue.task_done()

    def _copied_out(self, left: list[int]) -> None:
        """A batch's payload is copied out of the engine's memory: its bytes leave the queue's count."""
        with self.bytes_lock:
            self.queued_bytes -= left[0]
        left[0] = 0

    def _publish_batch(self, client: RpcClient, batch: list, left: list[int]) -> None:
        """Move one queued batch (``[keys, payload, ready, meta]``, emptied here so the payload's
        device memory goes once it is copied out) to the store, on the publishing thread: to the
        host, skip what the store holds, store the rest (:meth:`_copied_out` once on the host)."""
        keys, payload, ready, meta = batch
        batch.clear()
        rows = self._to_host(payload, ready)
        del payload
        self._copied_out(left)
        present = _call(client, CacheExists(request_id=new_request_id(), keys=keys), CacheExistsReply,
                        self.timeout_s).exists
        missing = [i for i, p in enumerate(present) if not p]
        self.counters["kv_publish_skipped"] += len(keys) - len(missing)
        step = max(1, self.max_fetch_bytes // meta.nbytes)
        for a in range(0, len(missing), step):
            chunk = missing[a:a + step]
            stored = self._store(client, [keys[i] for i in chunk], rows, chunk, meta)
            self.counters["kv_published_blocks"] += stored
            self.counters["kv_published_bytes"] += stored * meta.nbytes

    def _to_host(self, payload: torch.Tensor, ready) -> torch.Tensor:
        """The payload in host memory: for a device tensor, one copy on the publisher's stream
        (after the engine's gather, ``ready``) into :meth:`_staging`; only this thread waits for it."""
        if not payload.is_cuda:
            return payload.contiguous()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            host = self._staging(payload.shape[0])
            host.copy_(payload, non_blocking=True)
        self.copy_stream.synchronize()
        return host

    def _staging(self, num_blocks: int) -> torch.Tensor:
        """Host memory a published payload is copied into from the device."""
        return self._host_buffer(num_blocks)

    def _store(self, client: RpcClient, keys: list[bytes], rows: torch.Tensor, idx: list[int],
               meta: BlockMeta) -> int:
        """Move payloads ``rows[idx]`` to the store under ``keys``; returns how many it stored."""
        raise NotImplementedError

    def _host_buffer(self, num_blocks: int) -> torch.Tensor:
        """``[num_blocks, meta.nbytes]`` uint8 staging memory (pinned for a CUDA engine: torch's
        host allocator caches it, and keeps it until an asynchronous copy out of it is done)."""
        return torch.empty(num_blocks, self.meta.nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def _rows(self, values: list[bytes]) -> torch.Tensor:
        """Payloads (one per block) copied into one staging buffer."""
        out = self._host_buffer(len(values))
        dst = out.numpy()
        for i, v in enumerate(values):
            dst[i] = np.frombuffer(v, dtype=np.uint8)
        return out

    def fetch_async(self, keys: list[bytes]) -> FetchTicket:
        ticket = FetchTicket(list(keys))
        self.fetches[int(len(keys) * self.meta.nbytes > EXPRESS_BYTES)].put(ticket)
        return ticket

    def fetch(self, keys: list[bytes]) -> torch.Tensor:
        ticket = self.fetch_async(keys)
        ticket.event.wait()
        data = ticket.take()
        if ticket.on_release is not None:
            data = data.clone()
            ticket.release()
        return data

    def _fetch_work(self, lane: int) -> None:
        client = RpcClient(self.endpoint)  # this thread's own socket
        try:
            while (ticket := self.fetches[lane].get()) is not None:
                if callable(ticket):  # a store request queued for this lane's socket (a lease release)
                    ticket(client)
                    continue
                try:
                    t0 = time.monotonic()
                    ticket.data = self._fetch_run(lane, client, ticket)
                    if ticket.data.numel() >= 8 << 20:  # large enough to measure the path's speed
                        rate = ticket.data.numel() / max(time.monotonic() - t0, 1e-6)
                        self.fetch_bytes_per_s = 0.7 * self.fetch_bytes_per_s + 0.3 * rate
                except Exception as e:  # never leave the engine waiting on a ticket
                    self.counters["kv_fetch_errors"] += 1
                    log.warning("KV fetch failed (a miss): %s", e)
                    ticket.data = torch.empty(0, self.meta.nbytes, dtype=torch.uint8, device=self.device)
                ticket.t_done = time.perf_counter()
                ticket.event.set()
        finally:
            client.close()

    def _fetch_run(self, lane: int, client: RpcClient, ticket: FetchTicket) -> torch.Tensor:
        """The leading run of the ticket's keys, on the engine's device (the lane's fetch thread)."""
        t0 = time.monotonic()
        keys = ticket.keys
        parts, step = [], max(1, self.max_fetch_bytes // self.meta.nbytes)
        for a in range(0, len(keys), step):
            self.counters["kv_fetch_requests"] += 1
            t1 = time.monotonic()
            try:
                data = self._fetch(lane, client, keys[a:a + step])
            except (PeerUnreachable, OSError) as e:  # OSError: no room in /dev/shm for the mailbox
                self.counters["kv_fetch_errors"] += 1
                log.warning("KV fetch failed (a miss): %s", e)
                break
            finally:
                ticket.wait_s += time.monotonic() - t1
            parts.append(data)
            if data.shape[0] < min(step, len(keys) - a):
                break  # the run ended inside this batch
        data = parts[0] if len(parts) == 1 else (torch.cat(parts) if parts else self._host_buffer(0))
        if self.cuda:  # one copy to the device on this thread's stream; the host buffer is free after it
            stream = self.fetch_streams[lane]
            with torch.cuda.stream(stream):
                dev = torch.empty(data.shape, dtype=torch.uint8, device=self.device)
                dev.copy_(data, non_blocking=True)
            stream.synchronize()
            data = dev
        elif self.reuses_fetch_buffer and data.numel():
            data = data.clone()
        self.counters["kv_fetched_blocks"] += data.shape[0]
        self.counters["kv_fetched_bytes"] += data.numel()
        self.counters["kv_fetch_store_s"] += ticket.wait_s
        self.counters["kv_fetch_s"] += time.monotonic() - t0
        return data

    def _fetch(self, lane: int, client: RpcClient, keys: list[bytes]) -> torch.Tensor:
        """One store request, on fetch lane ``lane``'s thread: the leading run of ``keys`` the
        store holds, ``[n, meta.nbytes]`` uint8 on the host, valid until the lane's next fetch."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counters.items()}

    def close(self) -> None:
        self.flush(self.timeout_s)
        self.queue.put(None)
        for q in self.fetches:
            q.put(None)
        self.thread.join(timeout=self.timeout_s)
        for t in self.fetchers:
            t.join(timeout=self.timeout_s)
