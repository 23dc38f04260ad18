"""The native engine's side of the shared KV store (``--kv-cache``): fetches and publishing.

A mixin of :class:`rlcli.infer.engine.NativeEngine`, split out of it to keep the engine's
scheduling readable; it reads and writes the engine's state (``blocks``, ``kv``, ``fetches``,
``fetching``, ``new_fetches``, ``version``, ``counters``, ``waiting``, ``kv_caches``). The rules
(what is fetched, when a waiting prompt is admitted, why a fetch of other weights is dropped)
are in the engine's module docstring.
"""

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from rlcli.infer import kv_blocks
from rlcli.infer.kv_connector import FetchTicket, KVConnector
from rlcli.protocol import BlockMeta

if TYPE_CHECKING:
    from rlcli.infer.sequence import Sequence

FETCH_GRACE_S = 0.02
"""How long scheduling waits for a fetch it just started before running the step without it (the
fetches worth it are picked by their bytes and the connector's measured ``fetch_bytes_per_s``)."""
FETCH_HOLD_S = 1.0
"""How long a done fetch waits, untaken, for room to take in its blocks when its prompt is next
considered for admission (meanwhile it holds store slots or device memory); then its blocks go to
the local prefix cache as far as they fit, whether its prompt runs next or not."""

PUBLISH_PIECE_BYTES = 256 << 20
"""Most payload bytes one publish hands the connector: a long prompt's KV goes in pieces, several of
which fit its queue (``infer.kv_cache.publish_queue_mb``), each gathered on the device only once it fits."""


def publish_run(conn: KVConnector, keys: list[bytes], blocks: list[int],
                gather: Callable[[list[int]], torch.Tensor], wait: bool = False) -> int:
    """Publish the leading blocks of a chain run (``gather(blocks)`` makes their payloads) in pieces
    of at most ``PUBLISH_PIECE_BYTES`` while the connector's queue has room for them (with ``wait``,
    flushing it when it has none); returns how many went. A block after one that did not go could
    never be fetched (a fetch takes the longest leading run the store holds), and one publish of a
    long prompt's whole KV (2 GiB at 64k tokens of a 1B model) would not fit the queue at all."""
    nbytes = conn.meta.nbytes
    piece, done = max(1, PUBLISH_PIECE_BYTES // nbytes), 0
    while done < len(keys):
        n = min(len(keys) - done, piece, conn.publish_room() // nbytes)
        if n <= 0 and wait and conn.flush(conn.timeout_s):  # the queue is empty now
            n = min(len(keys) - done, piece, conn.publish_room() // nbytes)
        if n <= 0 or not conn.publish(keys[done:done + n], gather(blocks[done:done + n])):
            break
        done += n
    return done


@dataclass
class Fetch:
    """A background fetch of ``hashes[start:]`` of a prompt's block hashes, under weights ``version``."""

    ticket: FetchTicket
    hashes: list[bytes]
    start: int
    version: int
    t_start: float = 0.0  # perf_counter when it was asked for
    taken: bool = False  # its blocks went to the local prefix cache (or were dropped)


class SharedKVMixin:
    """Fetch from and publish to the shared store; see the module docstring."""

    def block_meta(self) -> BlockMeta:
        """The layout of this engine's blocks in a shared store (fingerprinted with the weights now
        served); a mixture-of-experts model's blocks carry their routes (R3)."""
        return kv_blocks.block_meta(self.model, self.block_size, self.dtype, with_routes=self.is_moe)

    @property
    def carries_routes(self) -> bool:
        """Every step records routes and every full block keeps them: an MoE model with a shared store."""
        return self.is_moe and self.kv is not None

    def _gather_blocks(self, blocks: list[int]) -> torch.Tensor:
        data = kv_blocks.gather(self.kv_caches, blocks)
        if not self.is_moe:
            return data
        a = self.model.args
        missing = torch.full((self.block_size, a.num_moe_layers, a.num_experts_per_tok), -1, dtype=torch.int16)
        routes = torch.stack([self.blocks.routes.get(b, missing) for b in blocks]).view(torch.uint8)
        pad = self.kv.meta.nbytes - data.shape[1] - routes[0].numel() if self.kv is not None else 0
        parts = [data, routes.reshape(len(blocks), -1).to(data.device)]
        if pad:
            parts.append(data.new_zeros(len(blocks), pad))
        return torch.cat(parts, dim=1)

    def _scatter_blocks(self, blocks: list[int], data: torch.Tensor) -> list | None:
        """Write fetched payloads into ``blocks``; returns each block's routes (None where the payload
        has none recorded), or None for a dense model."""
        if not self.is_moe:
            kv_blocks.scatter(self.kv_caches, blocks, data)
            return None
        a = self.model.args
        kv_bytes = sum(c[0].numel() * c.element_size() for layer in self.kv_caches for c in layer)
        kv_blocks.scatter(self.kv_caches, blocks, data[:, :kv_bytes])
        rb = kv_blocks.route_bytes(self.model, self.block_size)
        routes = data[:, kv_bytes:kv_bytes + rb].cpu().contiguous().view(torch.int16)
        routes = routes.reshape(len(blocks), self.block_size, a.num_moe_layers, a.num_experts_per_tok)
        return [r.clone() if bool((r >= 0).all()) else None for r in routes]

    def _start_fetch(self, seq: "Sequence", hashes: list[bytes], k: int) -> None:
        """Wait for the store's run of ``hashes[k:]``: a fetch in flight that holds the next
        block already, else a new one (at most as many blocks as could be taken in now)."""
        if (fetch := self.fetching.get(hashes[k])) is None:
            limit = min(len(hashes) - k, self.blocks.num_available - 2)  # leave room to compute the rest
            if limit <= 0:
                seq.fetched_to = len(hashes)
                return
            fetch = Fetch(self.kv.fetch_async(hashes[k:k + limit]), hashes[:k + limit], k, self.version,
                          time.perf_counter())
            self.fetches.append(fetch)
            self.new_fetches.append(fetch)
            for h in fetch.hashes[k:]:
                self.fetching.setdefault(h, fetch)
        end = k  # the blocks this fetch asks for on the prompt's behalf (chains agree up to there)
        while end < min(len(hashes), len(fetch.hashes)) and hashes[end] == fetch.hashes[end]:
            end += 1
        seq.fetch, seq.fetched_to = fetch, end

    def _take_fetches(self) -> None:
        """Copy into the local prefix cache the blocks of every done fetch that no waiting prompt
        waits for (its waiter was aborted, or the weights changed) or that has waited
        ``FETCH_HOLD_S``, so none is left behind. A fetch a prompt waits for is taken just before
        that prompt's admission (:meth:`_take_for`): taken all at once at a step's start, the
        blocks of several fetches evicted one another when the cache could not hold them all,
        and their prompts recomputed what had just been fetched."""
        if not any(f.ticket.done() for f in self.fetches):
            return
        waited = {id(s.fetch) for s in self.waiting if s.fetch is not None}
        now = time.perf_counter()
        for fetch in [f for f in self.fetches if f.ticket.done()]:
            if id(fetch) not in waited or fetch.version != self.version or now - fetch.ticket.t_done > FETCH_HOLD_S:
                self._take(fetch)

    def _take_for(self, fetch: Fetch) -> bool:
        """Take a waiting prompt's done fetch now, unless its blocks do not fit beside what is
        running (then False: the prompt keeps waiting, holding no blocks, for up to ``FETCH_HOLD_S``)."""
        if not fetch.taken:
            rows = fetch.ticket.data.shape[0] if fetch.ticket.data is not None else 0
            if rows + 2 > self.blocks.num_available and time.perf_counter() - fetch.ticket.t_done <= FETCH_HOLD_S:
                return False
            self._take(fetch)
        return True

    def _take(self, fetch: Fetch) -> None:
        self.fetches.remove(fetch)
        fetch.taken = True
        for h in fetch.hashes[fetch.start:]:
            if self.fetching.get(h) is fetch:
                del self.fetching[h]
        self._take_fetch(fetch)

    def _take_fetch(self, fetch: Fetch) -> None:
        now, ticket = time.perf_counter(), fetch.ticket
        self.counters["kv_fetches_taken"] += 1
        self.counters["kv_fetch_ready_s"] += ticket.t_done - fetch.t_start  # asked -> payloads in (lane queue included)
        self.counters["kv_fetch_taken_after_s"] += now - ticket.t_done  # in -> taken at a step's start
        try:
            self._take_fetched(fetch, fetch.ticket.take())
        finally:
            fetch.ticket.release()  # the payloads are copied into KV blocks (or dropped)

    def _take_fetched(self, fetch: Fetch, data: torch.Tensor) -> None:
        if fetch.version != self.version or data.shape[0] == 0:
            return  # computed under other weights: its keys can never match now
        # Extend the longest local match of the fetched chain (blocks may have come or gone since).
        held = self.blocks.match_prefix(fetch.hashes, with_routes=self.carries_routes)
        skip = len(held) - fetch.start
        if 0 <= skip < data.shape[0]:
            n = min(data.shape[0] - skip, self.blocks.num_available - 2)
            if n > 0:
                fresh = [self.blocks.allocate() for _ in range(n)]
                routes = self._scatter_blocks(fresh, data[skip:skip + n]) or [None] * n
                for block, h, r in zip(fresh, fetch.hashes[fetch.start + skip:], routes):
                    self.blocks.register(block, h, r)
                held += fresh
                self.counters["num_kv_fetched_tokens"] += n * self.block_size
        self.blocks.release(held)  # cached (evictable) until the waiting prompts match them

    def _publish(self, seq: "Sequence", finished: bool = False) -> None:
        """Hand the sequence's full blocks not yet in the store to the connector (enqueued only),
        in chain order, as far as its queue has room (:meth:`_publish_run`). What does not fit
        is offered again at the next call (the next prefill chunk, the end of the completion),
        and after the end from the backlog (:meth:`publish_pending`) while the local prefix cache
        still holds the blocks. A prefill server waits for room instead: it answers once the
        prompt's blocks are stored."""
        start, end = seq.num_published, len(seq.hashes)
        if self.kv is None or end <= start:
            return
        t0 = time.perf_counter()
        n = self._publish_run(seq.hashes[start:end], seq.blocks[start:end], wait=self.role == "prefill")
        seq.num_published = start + n
        if finished and start + n < end:
            self.publish_backlog.append((seq.hashes[start + n:end], seq.blocks[start + n:end]))
        self.counters["kv_publish_engine_s"] += time.perf_counter() - t0  # the engine thread's share

    def _publish_run(self, hashes: list[bytes], blocks: list[int], wait: bool = False) -> int:
        """:func:`publish_run` of this engine's blocks; a run cut short is counted (``kv_publish_deferred``)."""
        done = publish_run(self.kv, hashes, blocks, self._gather_blocks, wait)
        if done < len(hashes):
            self.counters["kv_publish_deferred"] += 1
        return done

    def publish_pending(self) -> None:
        """Publish what finished sequences left unpublished (the queue was full then), oldest
        first and as far as the queue has room, while the local prefix cache still holds each
        block under its hash (an evicted block ends its run)."""
        if self.kv is None:
            self.publish_backlog.clear()
            return
        while self.publish_backlog:
            hashes, blocks = self.publish_backlog[0]
            held = 0
            while held < len(hashes) and self.blocks.hash_to_block.get(hashes[held]) == blocks[held]:
                held += 1
            n = self._publish_run(hashes[:held], blocks[:held])
            if n < held:
                self.publish_backlog[0] = (hashes[n:], blocks[n:])
                return
            self.publish_backlog.pop(0)

    def _idle_until_fetched(self, timeout_s: float = 0.02) -> None:
        """Nothing could run: wait (briefly, so the server stays responsive) for a fetch that
        a waiting prompt needs."""
        fetch = next((s.fetch for s in self.waiting if s.fetch is not None and not s.fetch.ticket.done()), None)
        if fetch is not None:
            t0 = time.perf_counter()
            fetch.ticket.event.wait(timeout_s)
            self.counters["kv_fetch_idle_s"] += time.perf_counter() - t0
