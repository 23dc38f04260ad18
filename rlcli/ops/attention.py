"""Attention backends: one model code path, two ways of seeing the sequence.

Model files call ``ctx.attn(layer_idx, q, k, v, scale)`` with ``q [B, T, Hq, Dqk]``,
``k [B, T, Hkv, Dqk]``, ``v [B, T, Hkv, Dv]`` and get ``[B, T, Hq, Dv]`` back. What the
tokens are is the backend's business:

* :class:`PackedCausalAttention` (training, parity tests): each row holds one or more
  packed sequences; a sequence starts where ``position_ids == 0``. Attention is causal
  and block-diagonal over sequences. A row that is a single sequence takes SDPA's
  ``is_causal`` fast path.
* :class:`PagedAttention` (inference): tokens of many sequences are flattened into one
  row; new keys/values are written into a block-paged KV cache at ``slot_mapping`` and
  each sequence attends over its own blocks (``block_tables``) up to its context length.

The KV cache layout is per layer ``(k_cache, v_cache)`` of shape
``[num_blocks, block_size, Hkv, D]``, so K and V may have different head dims (MLA).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def _sdpa(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, scale: float,
          mask=None, is_causal: bool = False) -> torch.Tensor:
    gqa = q_BHTD.shape[1] != k_BHSD.shape[1]
    return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=mask, is_causal=is_causal,
                                          scale=scale, enable_gqa=gqa)


def doc_ids_from_positions(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Sequence index of every token in a packed row: a new sequence starts at position 0."""
    return torch.cumsum((position_ids_BT == 0).to(torch.int32), dim=-1)


class PackedCausalAttention:
    """Causal attention over rows of packed sequences (see module docstring)."""

    def __init__(self, position_ids_BT: torch.Tensor):
        starts = (position_ids_BT == 0).sum(dim=-1)
        self.single_sequence = bool((starts <= 1).all()) and bool((position_ids_BT[:, :1] == 0).all()) \
            if position_ids_BT.numel() else True
        self.mask_BTT = None
        if not self.single_sequence:
            doc = doc_ids_from_positions(position_ids_BT)
            T = position_ids_BT.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
            self.mask_BTT = (doc[:, :, None] == doc[:, None, :]) & causal

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.single_sequence:
            out = _sdpa(q, k, v, scale, is_causal=True)
        else:
            out = _sdpa(q, k, v, scale, mask=self.mask_BTT[:, None])
        return out.transpose(1, 2)


@dataclass
class PagedAttentionMetadata:
    """Where the tokens of one engine step go and what they attend to.

    Tokens are flattened ``[1, N]`` in sequence order; sequence ``i`` owns tokens
    ``query_start[i]:query_start[i+1]``, ends at position ``context_lens[i] - 1`` and keeps
    its KV in blocks ``block_tables[i]``. The first ``num_decode`` sequences have exactly
    one query token each and are attended in one batched call; the rest (prefill chunks)
    one by one.
    """

    slot_mapping: torch.Tensor  # int64 [N]: cache slot (block * block_size + offset) per new token
    query_start: list[int]  # len S + 1
    context_lens: list[int]  # len S: tokens in cache after this step, per sequence
    block_tables: torch.Tensor  # int64 [S, max_blocks], -1 padded
    block_size: int
    num_decode: int = 0
    # Gather index of the batched decode path, built once per step and shared by every layer.
    _decode_gather: tuple | None = field(default=None, repr=False)


class PagedAttention:
    """Reads and writes a block-paged KV cache; see :class:`PagedAttentionMetadata`."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: PagedAttentionMetadata):
        self.kv_caches = kv_caches
        self.meta = meta

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.kv_caches[layer_idx]
        q_NHD = q[0]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k[0].to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v[0].to(v_cache.dtype))
        outs = []
        if meta.num_decode:
            outs.append(self._decode(q_NHD[:meta.num_decode], k_cache, v_cache, scale))
        for i in range(meta.num_decode, len(meta.context_lens)):
            outs.append(self._prefill(i, q_NHD, k_cache, v_cache, scale))
        return torch.cat(outs, dim=0)[None]

    def _gather(self, cache: torch.Tensor, i: int) -> torch.Tensor:
        meta = self.meta
        n = meta.context_lens[i]
        blocks = meta.block_tables[i, :(n + meta.block_size - 1) // meta.block_size]
        return cache.index_select(0, blocks).flatten(0, 1)[:n]  # [n, H, D]

    def _prefill(self, i: int, q_NHD, k_cache, v_cache, scale) -> torch.Tensor:
        meta = self.meta
        q_i = q_NHD[meta.query_start[i]:meta.query_start[i + 1]]
        t, n = q_i.shape[0], meta.context_lens[i]
        k_i, v_i = self._gather(k_cache, i), self._gather(v_cache, i)
        # Query j sits at position n - t + j and sees keys 0 .. n - t + j.
        mask = torch.ones(t, n, dtype=torch.bool, device=q_i.device).tril(diagonal=n - t) if t > 1 else None
        out = _sdpa(q_i.transpose(0, 1)[None], k_i.transpose(0, 1)[None], v_i.transpose(0, 1)[None], scale,
                    mask=mask)
        return out[0].transpose(0, 1)

    def _decode(self, q_SHD, k_cache, v_cache, scale) -> torch.Tensor:
        """One query token per sequence. Sequences are bucketed by context length (powers of
        two) and each bucket is one padded, masked SDPA call, so a long-tailed batch wastes at
        most 2x on padding instead of padding everyone to the longest sequence."""
        meta = self.meta
        if meta._decode_gather is None:
            meta._decode_gather = self._decode_buckets(q_SHD.device)
        out = q_SHD.new_empty(q_SHD.shape[0], q_SHD.shape[1], v_cache.shape[-1])
        k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
        for rows, slots, valid in meta._decode_gather:
            # Padding slots are masked, but a masked score still multiplies its value: zero them so
            # stale non-finite cache contents cannot leak into other sequences (0 * NaN = NaN).
            keep = valid[:, :, None, None]
            k = k_flat[slots].masked_fill(~keep, 0)  # [S_b, L_b, H, D]
            v = v_flat[slots].masked_fill(~keep, 0)
            q = q_SHD[rows][:, :, None]
            out[rows] = _sdpa(q, k.transpose(1, 2), v.transpose(1, 2), scale, mask=valid[:, None, None, :])[:, :, 0]
        return out

    def _decode_buckets(self, device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per bucket: (row indices, cache slots [S_b, L_b], valid mask [S_b, L_b]); shared by all layers."""
        meta = self.meta
        lens = meta.context_lens[:meta.num_decode]
        buckets: dict[int, list[int]] = {}
        for i, n in enumerate(lens):
            buckets.setdefault(max(meta.block_size, 1 << (n - 1).bit_length()), []).append(i)
        out = []
        for _, rows in sorted(buckets.items()):
            width = max(lens[i] for i in rows)
            rows_t = torch.tensor(rows, device=device)
            pos = torch.arange(width, device=device)
            block_idx = (pos // meta.block_size).clamp(max=meta.block_tables.shape[1] - 1)
            blocks = meta.block_tables[rows_t][:, block_idx].clamp(min=0)
            slots = blocks * meta.block_size + (pos % meta.block_size)[None]
            valid = pos[None] < torch.tensor([lens[i] for i in rows], device=device)[:, None]
            out.append((rows_t, slots, valid))
        return out


@dataclass
class RoutingContext:
    """R3 routing: record the experts each token was sent to, or replay given ones.

    ``replay`` is ``[N, num_moe_layers, top_k]`` expert ids for the N flattened tokens of
    the forward pass. Recorded routes are appended per MoE layer as ``[N, top_k]``. Under
    replay each MoE layer also counts, on device, the tokens whose own top-k (what this
    router would pick) differs from the replayed set: ``num_disagree`` of ``num_pairs``
    token-layer pairs, over the tokens ``counted`` marks (bool [N]; a sequence's last
    token has no recorded route of its own) or all of them.
    """

    replay: torch.Tensor | None = None
    record: bool = False
    recorded: list[torch.Tensor] = field(default_factory=list)
    counted: torch.Tensor | None = None
    num_disagree: torch.Tensor | int = 0
    num_pairs: torch.Tensor | int = 0

    def stacked(self) -> torch.Tensor:
        """Recorded routes as ``[N, num_moe_layers, top_k]``."""
        return torch.stack(self.recorded, dim=1)


@dataclass
class ForwardContext:
    """Everything a forward pass needs besides tokens and positions."""

    attn: object  # PackedCausalAttention | PagedAttention | any callable with that signature
    routing: RoutingContext | None = None
    position_ids: torch.Tensor | None = None  # [B, T] of the tokens; CausalLM.hidden_states fills it in
    # DSA: each indexer layer's top-k choice, by layer, for the "shared" layers after it. Keyed by
    # layer (not "the last one") so that recomputing a block under activation checkpointing reads
    # the same choice as its forward did.
    dsa_selection: dict = field(default_factory=dict)
