"""KV-cache block accounting with salted prefix caching.

The cache is ``num_blocks`` blocks of ``block_size`` tokens. A sequence owns a list of
blocks; full blocks are content-addressed by a hash chain over (key salt, tokens), so a
later sequence with the same key salt and prefix reuses them instead of recomputing. The
engine builds the key salt from the request's cache salt *and* the weights version that
computed the block (``"<salt>|w<version>"``, see ``NativeEngine._register_full_blocks``),
and looks up with the version it serves now: KV computed by other weights is never
reused, whatever salt a request carries, while sequences already running keep their
own blocks.

Blocks nobody references but whose content is still valid stay in an LRU pool and are
handed out (and forgotten) only when the free list is empty.

For MoE routing replay (R3) a block may also keep the experts its tokens were routed to
(``routes[block]``, ``[block_size, layers, top_k]``), registered by a request that
recorded them; requests that need routes match only blocks that have them.
"""

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Sequence as Seq


def chain_hash(parent: bytes | None, salt: str, tokens: Seq[int]) -> bytes:
    """Stable across processes and hosts, so block keys can name blocks in a shared store."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(salt.encode())
    h.update(b"\0")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free: deque[int] = deque(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.block_hash: dict[int, bytes] = {}
        self.hash_to_block: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.routes: dict[int, object] = {}  # block -> its tokens' routes (a tensor), when recorded
        self.num_hits = 0  # prompt tokens served from cache
        self.num_queries = 0  # prompt tokens looked up

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self.hash_to_block.pop(self.block_hash.pop(block), None)
            self.routes.pop(block, None)
        else:
            raise RuntimeError("KV cache exhausted")  # the scheduler checks num_available first
        self.refcount[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refcount[block] == 0:
            self.evictable.pop(block, None)
        self.refcount[block] += 1

    def release(self, blocks: Seq[int]) -> None:
        for block in blocks:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if block in self.block_hash:
                    self.evictable[block] = None
                else:
                    self.free.append(block)

    def block_hashes(self, tokens: Seq[int], salt: str) -> list[bytes]:
        """Hash chain of every full block of ``tokens``."""
        out, parent = [], None
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = chain_hash(parent, salt, tokens[start:start + self.block_size])
            out.append(parent)
        return out

    def match_prefix(self, hashes: Seq[bytes], with_routes: bool = False) -> list[int]:
        """Cached blocks for the longest prefix of ``hashes`` (that also kept their routes, with
        ``with_routes``); each is shared (refcount + 1)."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None or (with_routes and block not in self.routes):
                break
            self.share(block)
            blocks.append(block)
        return blocks

    def register(self, block: int, h: bytes, routes=None) -> None:
        """Publish a full, computed block under hash ``h`` (first writer wins), with the routes
        of its tokens when given (they are added to a first writer that had none)."""
        if not self.enable_prefix_caching:
            return
        if h not in self.hash_to_block and block not in self.block_hash:
            self.hash_to_block[h] = block
            self.block_hash[block] = h
        owner = self.hash_to_block.get(h)
        if routes is not None and owner is not None and owner not in self.routes:
            self.routes[owner] = routes

    def reset_prefix_cache(self) -> None:
        for block in list(self.evictable):
            self.free.append(block)
        self.evictable.clear()
        self.hash_to_block.clear()
        self.block_hash.clear()
        self.routes.clear()
