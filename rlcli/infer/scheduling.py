"""The native engine's scheduling: which sequences a step computes, and how many tokens each.

A mixin of :class:`rlcli.infer.engine.NativeEngine`, split out of it as :mod:`rlcli.infer.shared_kv`
is; it reads and writes the engine's state (``running``, ``waiting``, ``blocks``, ``block_size``,
``max_num_batched_tokens``, ``max_num_seqs``, ``version``, ``counters``, ``kv``, ``is_moe``). Running
sequences come first, one decode token each or their prompt's next chunk, the newest preempted
under memory pressure; then waiting ones are admitted in order within the token budget, each
taking the longest prefix cached for its salt under the weights served now (the rules are in the
engine's module docstring).
"""

import time

import torch

from rlcli.infer.sequence import RouteLog, Sequence
from rlcli.infer.shared_kv import FETCH_GRACE_S


class SchedulingMixin:
    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        total = seq.num_computed + num_tokens
        return max(0, (total + self.block_size - 1) // self.block_size - len(seq.blocks))

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it re-prefills its tokens when readmitted."""
        self.running.remove(seq)
        self.blocks.release(seq.blocks)
        seq.blocks, seq.hashes, seq.num_computed, seq.routes, seq.partial_versions = [], [], 0, RouteLog(), set()
        seq.fetched_to = 0
        self.waiting.appendleft(seq)
        self.counters["num_preemptions"] += 1

    def _fork_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks a prompt finishing this step needs for its n - 1 copies of a partial last block."""
        total = seq.num_computed + num_tokens
        if seq.index >= 0 or total < len(seq.tokens) or total % self.block_size == 0:
            return 0
        return seq.req.sampling.n - 1

    def _allocate(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self._blocks_needed(seq, num_tokens)):
            seq.blocks.append(self.blocks.allocate())

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of tokens to compute) for this step, single-token decodes first."""
        batch: list[tuple[Sequence, int]] = []
        self._take_fetches()
        budget = self.max_num_batched_tokens
        reserved = 0  # blocks promised to prompts that fork at the end of this step
        # Running sequences: one decode token each, or the next chunk of a long prompt.
        # Under memory pressure the newest running sequences are preempted.
        preempted: set[Sequence] = set()
        bs, available = self.block_size, self.blocks.num_available
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq in preempted:
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            # (_blocks_needed and _fork_blocks inline: a decode needs a block at a block's first token)
            need = max(0, (seq.num_computed + n + bs - 1) // bs - len(seq.blocks))
            fork = self._fork_blocks(seq, n) if seq.index < 0 else 0
            while need + fork > available - reserved:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(victim)
                available = self.blocks.num_available
                if victim is seq:
                    break
            else:
                reserved += fork
                for _ in range(need):
                    seq.blocks.append(self.blocks.allocate())
                available -= need
                batch.append((seq, n))
                budget -= n
        self.new_fetches = []
        budget, reserved = self._admit(batch, budget, reserved)
        # A fetch started now is often done in a few ms (a miss, or a few blocks): wait for the
        # ones expected within FETCH_GRACE_S, so their prompts join this step instead of the next
        # one (a whole forward later); larger ones stay in the background.
        quick = [f for f in self.new_fetches
                 if 0.002 + len(f.ticket.keys) * self.kv.meta.nbytes / self.kv.fetch_bytes_per_s <= FETCH_GRACE_S]
        if quick and budget > 0:
            t0 = time.perf_counter()
            deadline = t0 + FETCH_GRACE_S
            for fetch in quick:
                fetch.ticket.event.wait(max(0.0, deadline - time.perf_counter()))
            self.counters["kv_fetch_idle_s"] += time.perf_counter() - t0
            budget, reserved = self._admit(batch, budget, reserved)
        batch.sort(key=lambda item: not (item[1] == 1 and item[0].num_computed > 0))
        return batch

    def _admit(self, batch: list[tuple[Sequence, int]], budget: int, reserved: int) -> tuple[int, int]:
        """Admit waiting sequences within the token budget, in order; prompts whose KV is still
        being fetched from the shared store are passed over until it is in."""
        i = 0
        # A prompt not yet forked counts as the n sequences it becomes when its prefill ends.
        slots = sum(1 if seq.index >= 0 else seq.req.sampling.n for seq in self.running)
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            need = 1 if seq.index >= 0 else seq.req.sampling.n
            if slots + need > self.max_num_seqs:
                break
            if seq.num_computed == 0 and not seq.blocks and not self._match_prefix(seq):
                i += 1
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if self._blocks_needed(seq, n) + self._fork_blocks(seq, n) > self.blocks.num_available - reserved:
                # Waiting sequences hold no blocks: give the matched prefix back (it stays cached).
                self.blocks.release(seq.blocks)
                seq.blocks, seq.hashes, seq.num_computed = [], [], 0
                if not self.running:
                    raise RuntimeError("KV cache too small for one sequence; raise infer.kv_cache_memory_mb")
                break
            reserved += self._fork_blocks(seq, n)
            self._allocate(seq, n)
            del self.waiting[i]
            self.running.append(seq)
            slots += need
            batch.append((seq, n))
            budget -= n
        return budget, reserved

    def _match_prefix(self, seq: Sequence) -> bool:
        """Take the longest cached prefix of the prompt (local, then the shared store's); False
        while the prompt waits for a fetch (it then holds no blocks)."""
        if seq.fetch is not None:
            if not seq.fetch.ticket.done() or not self._take_for(seq.fetch):
                return False
            if seq.fetch.version != self.version:
                seq.fetched_to = 0  # dropped: its keys name other weights; ask again under these
            seq.fetch = None  # its blocks are in the local prefix cache now
        # Never take the whole prompt from cache: the last position must run to give logits.
        # Only blocks computed by the weights served now can match (see _register_full_blocks).
        if seq.pending_hashes is not None and seq.pending_hashes[0] == self.version:
            hashes = seq.pending_hashes[1]  # (the tokens of a waiting prompt do not change)
        else:
            # A prompt being scored from token k needs the logits from position k - 1 on: no cached block past it.
            scored_from = seq.req.sampling.prompt_logprobs
            upto = len(seq.tokens) - 1 if scored_from < 1 else scored_from - 1
            hashes = self.blocks.block_hashes(seq.tokens[:upto], f"{seq.req.salt}|w{self.version}")
        seq.pending_hashes = None
        # With a shared store an MoE engine keeps every block's routes, and matches only blocks that
        # have them, so every sequence's routes run from its first token.
        want_routes = self.is_moe and (seq.req.sampling.return_routing or self.carries_routes)
        blocks = self.blocks.match_prefix(hashes, with_routes=want_routes)
        # Ask the store for what is missing, unless an earlier ask (its own, or one it waited
        # for) covered these blocks already: the store did not have them then.
        if self.kv is not None and seq.fetched_to <= len(blocks) < len(hashes):
            self.blocks.release(blocks)  # a waiting prompt holds no blocks
            self._start_fetch(seq, hashes, len(blocks))
            if seq.fetch is not None:
                seq.pending_hashes = (self.version, hashes)
                return False
            blocks = self.blocks.match_prefix(hashes, with_routes=want_routes)
        seq.blocks = blocks
        seq.hashes = hashes[:len(blocks)]
        seq.num_published = len(blocks) if self.kv is not None else 0
        seq.num_computed = len(blocks) * self.block_size
        if want_routes and blocks:  # cached blocks keep the routes their tokens took
            seq.routes = RouteLog(torch.cat([self.blocks.routes[b] for b in blocks]).numpy())
        self.blocks.num_queries += len(seq.tokens)
        self.blocks.num_hits += seq.num_computed
        if seq.index < 0:
            seq.req.num_cached_tokens = seq.num_computed
        return True

