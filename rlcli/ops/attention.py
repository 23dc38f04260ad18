"""Attention backends: one model code path, two ways of seeing the sequence.

Every attention layer of a model owns an :class:`InnerAttention` module and calls it
with ``q [B, T, Hq, Dqk]``, ``k [B, S, Hkv, Dqk]``, ``v [B, S, Hkv, Dv]``; it runs the
backend of the forward pass, ``ctx.attn`` (an ``nn.Module`` called as
``attn(layer_idx, q, k, v, scale)``), and returns ``[B, T, Hq, Dv]``. What the tokens
are is the backend's business:

* :class:`PackedCausalAttention` (training, parity tests; in
  :mod:`rlcli.ops.document_attention`): each row holds one or more packed sequences; a
  sequence starts where ``position_ids == 0``. Attention is causal within each sequence,
  computed per document (SDPA), with a FlexAttention block mask or with varlen flash
  attention; no dense ``[T, T]`` mask is built. Under context parallelism ``S`` (the
  gathered keys) is longer than ``T`` (this rank's queries).
* :class:`PagedAttention` (inference): tokens of many sequences are flattened into one
  row; new keys/values are written into a block-paged KV cache at ``slot_mapping`` and
  each sequence attends over its own blocks (``block_tables``) up to its context length
  (with ``paged_decode`` on CUDA, decodes through :mod:`rlcli.ops.paged_decode`, in place).
  With ``batch_invariant`` both paths run :func:`rlcli.ops.batch_invariant.invariant_attention`,
  as the trainer's ``invariant`` backend does, so a token's attention has the same bits in
  the engine and in the trainer.

The KV cache layout is per layer ``(k_cache, v_cache)`` of shape
``[num_blocks, block_size, Hkv, D]``, so K and V may have different head dims (MLA).
"""

import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from rlcli.ops.batch_invariant import invariant_attention, invariant_kernels, on_kernels
from rlcli.ops.document_attention import (PackedCausalAttention, _sdpa, _varlen_attn, doc_ids_from_positions,
                                          varlen_attention)

_PAGED_ON_CPU = os.environ.get("RLCLI_PAGED_DECODE_ON_CPU") == "1"  # the engine tests under Triton's interpreter


def _paged_decode_for(q: torch.Tensor):
    """:mod:`rlcli.ops.paged_decode` where it serves ``q``'s decodes (CUDA, Triton importing), else None."""
    if not (q.is_cuda or (_PAGED_ON_CPU and q.device.type == "cpu")):
        return None
    try:
        from rlcli.ops import paged_decode
    except (ImportError, OSError):
        return None
    return paged_decode


__all__ = ["ForwardContext", "InnerAttention", "PackedCausalAttention", "PagedAttention", "PagedAttentionMetadata",
           "RoutingContext", "doc_ids_from_positions"]


class InnerAttention(nn.Module):
    """The attention call of one layer, as a module of the model: ``forward(q, k, v, scale,
    ctx)`` runs the forward pass's backend, ``ctx.attn``. It holds no weights; it exists so
    that parallelism applied from outside can hook every layer's attention (context
    parallelism all-gathers ``k`` and ``v`` in a forward pre-hook).

    In a compiled block, a backend whose ``in_graph`` is False runs eagerly: a graph break
    here, whose call carries only tensors, the scale and the context (passing ``layer_idx``
    across the break would make it a constant of the graph, one frame per layer)."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, q_BTHD: torch.Tensor, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor, scale: float,
                ctx: "ForwardContext") -> torch.Tensor:
        if getattr(ctx.attn, "in_graph", True):
            return ctx.attn(self.layer_idx, q_BTHD, k_BSHD, v_BSHD, scale)
        return self._eager(q_BTHD, k_BSHD, v_BSHD, scale, ctx)

    @torch.compiler.disable
    def _eager(self, q_BTHD, k_BSHD, v_BSHD, scale, ctx) -> torch.Tensor:
        return ctx.attn(self.layer_idx, q_BTHD, k_BSHD, v_BSHD, scale)


@dataclass
class PagedAttentionMetadata:
    """Where the tokens of one engine step go and what they attend to.

    Tokens are flattened ``[1, N]`` in sequence order; sequence ``i`` owns tokens
    ``query_start[i]:query_start[i+1]``, ends at position ``context_lens[i] - 1`` and keeps
    its KV in blocks ``block_tables[i]``. The first ``num_decode`` sequences have exactly
    one query token each and are attended in one batched call; the rest (prefill chunks)
    one by one. On CUDA in half precision the decodes share one varlen flash call and the
    prefill chunks another (:meth:`PagedAttention._varlen`); with ``paged_decode`` the decodes
    run the paged decode kernel instead, which reads the cache in place
    (:mod:`rlcli.ops.paged_decode`); under ``batch_invariant`` on CUDA all of them one call of
    the invariant kernel (:meth:`PagedAttention._invariant_kernel`).
    """

    slot_mapping: torch.Tensor  # int64 [N]: cache slot (block * block_size + offset) per new token
    query_start: list[int]  # len S + 1
    context_lens: list[int]  # len S: tokens in cache after this step, per sequence
    block_tables: torch.Tensor  # int64 [S, max_blocks], -1 padded
    block_size: int
    num_decode: int = 0
    # The same tables on the host, where the caller has them (the engine): the decode buckets are
    # planned from them without reading the device's copy back.
    block_tables_host: np.ndarray | None = field(default=None, repr=False)
    # Gather index of the batched decode path, built once per step and shared by every layer.
    _decode_gather: tuple | None = field(default=None, repr=False)
    # The varlen path's (cache slots of every sequence's context, cu_q, cu_k, max_q, max_k), likewise.
    _varlen_plan: tuple | None = field(default=None, repr=False)
    # The invariant kernel's (context slots, cu_q, cu_k, max_q) under batch_invariant on CUDA, likewise.
    _invariant_plan: tuple | None = field(default=None, repr=False)
    # The paged decode kernel's spans per sequence, fixed (a CUDA graph's, rlcli.infer.cuda_graphs);
    # None: chosen from the longest context.
    decode_splits: int | None = None
    # The decodes' context lengths on the device for the paged decode kernel, and the longest, likewise.
    _decode_lens: tuple[torch.Tensor, int] | None = field(default=None, repr=False)


class PagedAttention(nn.Module):
    """Reads and writes a block-paged KV cache; see :class:`PagedAttentionMetadata`.
    ``batch_invariant``: attend in the fixed order of :func:`invariant_attention`. ``paged_decode``:
    the decodes run :mod:`rlcli.ops.paged_decode` on CUDA (where Triton imports)."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: PagedAttentionMetadata,
                 batch_invariant: bool = False, paged_decode: bool | None = None):
        super().__init__()
        self.kv_caches = kv_caches
        self.meta = meta
        self.batch_invariant = batch_invariant
        # Decodes through rlcli.ops.paged_decode where it runs (the engine's infer.engine.paged_decode;
        # by default only in the kernel tests under Triton's interpreter).
        self.paged_decode = _PAGED_ON_CPU if paged_decode is None else paged_decode

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.kv_caches[layer_idx]
        q_NHD = q[0]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k[0].to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v[0].to(v_cache.dtype))
        return self.attend(q_NHD, k_cache, v_cache, scale)[None]

    def attend(self, q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """The step's attention over caches already holding its keys and values, ``[N, H, Dv]``
        (``v_cache`` may be a view of ``k_cache``'s first features: MLA's latent under the flag)."""
        meta = self.meta
        if self.batch_invariant and on_kernels(q_NHD):
            return self._invariant_kernel(q_NHD, k_cache, v_cache, scale)
        paged = self.decodes_in_place(q_NHD, k_cache, v_cache)
        if self._use_varlen(q_NHD, k_cache, v_cache):
            return self._varlen(q_NHD, k_cache, v_cache, scale, paged)
        outs = []
        if paged:
            outs.append(self.paged_decode_step(q_NHD[:meta.num_decode], k_cache, v_cache, scale))
        elif meta.num_decode:
            outs.append(self._decode(q_NHD[:meta.num_decode], k_cache, v_cache, scale))
        for i in range(meta.num_decode, len(meta.context_lens)):
            outs.append(self._prefill(i, q_NHD, k_cache, v_cache, scale))
        return torch.cat(outs, dim=0)

    def decodes_in_place(self, q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether this step's decodes run :meth:`paged_decode_step`: the engine's ``paged_decode``,
        some decodes, not the batch-invariant order, and the kernel available for ``q``'s device and
        its tiles fitting these head widths (fp32 at MLA's latent width does not)."""
        if not (self.paged_decode and self.meta.num_decode and not self.batch_invariant):
            return False
        kernel = _paged_decode_for(q_NHD)
        return kernel is not None and kernel.fits(q_NHD.shape[1] // k_cache.shape[2], q_NHD.shape[-1],
                                                  v_cache.shape[-1], q_NHD.dtype)

    def _use_varlen(self, q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether this step runs :meth:`_varlen`: flash kernels (CUDA, half precision, one
        head size for q, k and v), not the batch-invariant order."""
        return (q_NHD.is_cuda and q_NHD.dtype in (torch.float16, torch.bfloat16) and not self.batch_invariant
                and q_NHD.shape[-1] == k_cache.shape[-1] == v_cache.shape[-1] and _varlen_attn() is not None)

    def decode_lens(self, device: torch.device) -> torch.Tensor:
        """The decodes' context lengths on ``device`` (int32), copied once per step and shared by
        every layer (with the longest, for the kernel's spans); a graph's are its static buffer."""
        meta = self.meta
        if meta._decode_lens is None:
            lens = meta.context_lens[:meta.num_decode]
            meta._decode_lens = (torch.tensor(lens, dtype=torch.int32).to(device, non_blocking=True), max(lens))
        return meta._decode_lens[0]

    def paged_decode_step(self, q_SHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          scale: float) -> torch.Tensor:
        """The decodes by :func:`rlcli.ops.paged_decode.paged_decode`, reading the cache in place."""
        meta = self.meta
        lens_t = self.decode_lens(q_SHD.device)
        longest = meta._decode_lens[1]
        spans = {"max_context_len": longest} if meta.decode_splits is None else {"num_splits": meta.decode_splits}
        return _paged_decode_for(q_SHD).paged_decode(q_SHD, k_cache, v_cache, meta.block_tables[:meta.num_decode],
                                                     lens_t, scale, **spans)

    def _varlen(self, q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                paged: bool = False) -> torch.Tensor:
        """Every sequence of the step in varlen flash calls over its whole context gathered from
        the cache (one gather per K and V, at slots built once per step for all layers). Flash's
        causal mask is aligned to the bottom right, so a chunk after cached KV needs no mask.
        Decodes take their own call with grouped heads folded into the query rows: the query
        heads of one K/V head become that sequence's rows (no mask: one position sees all its
        keys), so a kernel block reads each K/V head once for its whole group instead of once
        per query head. SDPA's per-shape kernels are what this replaces on the GPU: with
        grouped heads and a padding mask the decode call went to cuDNN, which builds an
        execution plan for every new key length, about 3 ms of host time per layer and step on
        an H200 (a decode step of a 1B model took 62 ms, 7.5 ms of it on the device). With
        ``paged`` (the paged decode kernel imports) the decodes read the cache in place through
        :meth:`_paged_decode` instead, and only the prefill chunks' contexts are gathered."""
        meta = self.meta
        if meta._varlen_plan is None:
            meta._varlen_plan = self._plan_varlen(q_NHD.device, q_NHD.shape[1] // k_cache.shape[2], paged)
        slots, decodes, prefills = meta._varlen_plan
        outs = [self.paged_decode_step(q_NHD[:meta.num_decode], k_cache, v_cache, scale)] if paged else []
        if paged and prefills is None:
            return outs[0]
        k = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, slots)
        v = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, slots)
        if decodes is not None:
            nd, groups, cu_q, cu_k, max_k = decodes
            Hkv = k.shape[1]
            q_dec = q_NHD[:nd].view(nd, Hkv, groups, -1).transpose(1, 2).reshape(nd * groups, Hkv, -1)
            out = varlen_attention(q_dec, k, v, cu_q, cu_k, groups, max_k, scale, causal=False)
            outs.append(out.view(nd, groups, Hkv, -1).transpose(1, 2).reshape(nd, Hkv * groups, -1))
        if prefills is not None:
            first_q, first_k, cu_q, cu_k, max_q, max_k = prefills
            outs.append(varlen_attention(q_NHD[first_q:], k[first_k:], v[first_k:], cu_q, cu_k, max_q, max_k, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _invariant_kernel(self, q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          scale: float) -> torch.Tensor:
        """``batch_invariant`` on CUDA: every sequence of the step in one call of the invariant
        attention kernel (:mod:`rlcli.ops.invariant_kernels`), which reads the keys and values in
        the cache through their slots; the trainer's packed rows run the same kernel."""
        meta = self.meta
        if meta._invariant_plan is None:
            slots, cu_k = self._context_slots(q_NHD.device)
            starts = meta.query_start
            cu_q = torch.tensor(starts, dtype=torch.int64).to(q_NHD.device, non_blocking=True)
            meta._invariant_plan = (slots, cu_q, cu_k, max(b - a for a, b in zip(starts, starts[1:])))
        slots, cu_q, cu_k, max_q = meta._invariant_plan
        return invariant_kernels().attention(q_NHD, k_cache.view(-1, *k_cache.shape[2:]),
                                             v_cache.view(-1, *v_cache.shape[2:]), slots, cu_q, cu_k, max_q, scale)

    def _context_slots(self, device: torch.device, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache slots of the contexts of sequences ``first:``, flattened in sequence and position
        order; int64 ``cu_seqlens`` of those contexts)."""
        meta = self.meta
        lens = meta.context_lens[first:]
        total = sum(lens)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
        cu_k = torch.zeros(len(lens) + 1, dtype=torch.int64, device=device)
        cu_k[1:] = torch.cumsum(lens_t, 0)
        seq = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t, output_size=total)
        pos = torch.arange(total, device=device) - cu_k[:-1].repeat_interleave(lens_t, output_size=total)
        tables = meta.block_tables[first:]
        return tables[seq, pos // meta.block_size] * meta.block_size + pos % meta.block_size, cu_k

    def _plan_varlen(self, device: torch.device, groups: int, paged: bool = False) -> tuple:
        """(context slots of every sequence, the decodes' call, the prefill chunks' call);
        ``groups``: query heads per K/V head. ``paged``: the decodes run :meth:`_paged_decode`, so
        only the prefill chunks' contexts are gathered (and no decodes' call is planned)."""
        meta = self.meta
        lens, starts = meta.context_lens, meta.query_start
        nd = meta.num_decode
        first = nd if paged else 0  # the first sequence whose context is gathered
        if first == len(lens):
            return None, None, None
        slots, cu_k = self._context_slots(device, first)
        cu_k = cu_k.to(torch.int32)
        decodes = prefills = None
        if nd and not paged:
            cu_q = torch.arange(nd + 1, dtype=torch.int32, device=device) * groups
            decodes = (nd, groups, cu_q, cu_k[:nd + 1], max(lens[:nd]))
        if nd < len(lens):
            first_k = sum(lens[first:nd])
            cu_q = torch.tensor([q - starts[nd] for q in starts[nd:]], dtype=torch.int32, device=device)
            max_q = max(b - a for a, b in zip(starts[nd:], starts[nd + 1:]))
            prefills = (starts[nd], first_k, cu_q, cu_k[nd - first:] - first_k, max_q, max(lens[nd:]))
        return slots, decodes, prefills

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
        q, k, v = q_i.transpose(0, 1)[None], k_i.transpose(0, 1)[None], v_i.transpose(0, 1)[None]
        if self.batch_invariant:
            return invariant_attention(q, k, v, scale)[0].transpose(0, 1)
        if t > 1 and q_i.is_cuda:
            return prefill_attention(q, k, v, scale)[0].transpose(0, 1)
        # Query j sits at position n - t + j and sees keys 0 .. n - t + j.
        mask = torch.ones(t, n, dtype=torch.bool, device=q_i.device).tril(diagonal=n - t) if t > 1 else None
        return _sdpa(q, k, v, scale, mask=mask)[0].transpose(0, 1)

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
            # Padding slots read the sequence's own first key and value (see _decode_buckets).
            k = k_flat.index_select(0, slots.flatten()).view(*slots.shape, *k_flat.shape[1:])  # [S_b, L_b, H, D]
            v = v_flat.index_select(0, slots.flatten()).view(*slots.shape, *v_flat.shape[1:])
            q = q_SHD[rows][:, :, None]
            if self.batch_invariant:
                out[rows] = invariant_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale, valid.sum(1))[:, :, 0]
                continue
            out[rows] = _sdpa(q, k.transpose(1, 2), v.transpose(1, 2), scale, mask=valid[:, None, None, :])[:, :, 0]
        return out

    def _decode_buckets(self, device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per bucket: (row indices, cache slots [S_b, L_b], valid mask [S_b, L_b]); shared by all layers.
        Planned on the host and sent to ``device`` in one copy. A padding position is masked, but a
        masked score still multiplies its value (0 * NaN = NaN): its slot is the sequence's own
        first one, written by this sequence, so no stale cache contents of another sequence are
        read and nothing needs zeroing per layer."""
        meta = self.meta
        tables = meta.block_tables_host if meta.block_tables_host is not None else meta.block_tables.cpu().numpy()
        bs = meta.block_size
        lens = meta.context_lens[:meta.num_decode]
        buckets: dict[int, list[int]] = {}
        for i, n in enumerate(lens):
            buckets.setdefault(max(bs, 1 << (n - 1).bit_length()), []).append(i)
        parts, shapes = [], []
        for _, rows in sorted(buckets.items()):
            rows_np = np.asarray(rows, dtype=np.int64)
            rows_lens = np.asarray([lens[i] for i in rows], dtype=np.int64)
            pos = np.arange(int(rows_lens.max()), dtype=np.int64)
            block_idx = np.minimum(pos // bs, tables.shape[1] - 1)
            slots = tables[rows_np][:, block_idx].clip(min=0) * bs + pos % bs
            valid = pos[None] < rows_lens[:, None]
            slots = np.where(valid, slots, slots[:, :1])
            parts += [rows_np, slots.ravel(), valid.ravel().astype(np.int64)]
            shapes.append(slots.shape)
        flat = torch.from_numpy(np.concatenate(parts)).to(device)
        pieces = flat.split([p.size for p in parts])
        return [(pieces[3 * b], pieces[3 * b + 1].view(shape), pieces[3 * b + 2].view(shape) != 0)
                for b, shape in enumerate(shapes)]


def prefill_attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt chunk's attention without a dense mask (the engine's CUDA path): the T queries
    are the last T of S positions, each sees the keys up to its own (causal, bottom-right
    aligned). A whole prompt (T == S) runs flash attention on the grouped KV heads; a chunk
    after cached KV runs the memory-efficient kernel's bottom-right causal mask, with the KV
    heads repeated (that kernel takes no grouped heads). A boolean mask with grouped heads
    would fall back to the math kernel, which builds the ``[Hq, T, S]`` scores."""
    t, s = q_BHTD.shape[2], k_BHSD.shape[2]
    if t == s:
        return _sdpa(q_BHTD, k_BHSD, v_BHSD, scale, is_causal=True)
    groups = q_BHTD.shape[1] // k_BHSD.shape[1]
    if groups > 1:
        k_BHSD, v_BHSD = k_BHSD.repeat_interleave(groups, dim=1), v_BHSD.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=causal_lower_right(t, s), scale=scale)


class RouterTally:
    """Router disagreement under replay, summed over a forward's MoE layers (device scalars).

    Its own class, not fields of :class:`RoutingContext`: FSDP2 moves and casts a module's inputs
    with ``torch.distributed.utils._apply_to_tensors``, which rebuilds every dataclass it meets
    (``dataclasses.replace``), so each sharded layer saw a copy of the context and counts added to
    the copy's fields never reached the caller's. An object of another class passes through as is.
    """

    def __init__(self) -> None:
        self.disagree: torch.Tensor | int = 0
        self.pairs: torch.Tensor | int = 0

    def add(self, disagree: torch.Tensor, pairs: torch.Tensor) -> None:
        self.disagree = self.disagree + disagree
        self.pairs = self.pairs + pairs


@dataclass
class RoutingContext:
    """R3 routing: record the experts each token was sent to, or replay given ones.

    ``replay`` is ``[N, num_moe_layers, top_k]`` expert ids for the N flattened tokens of
    the forward pass. Recorded routes are appended per MoE layer as ``[N, top_k]``. Under
    replay each MoE layer also counts in ``tally``, on device, the tokens whose own top-k
    (what this router would pick) differs from the replayed set: ``num_disagree`` of
    ``num_pairs`` token-layer pairs, over the tokens ``counted`` marks (bool [N]; a sequence's
    last token has no recorded route of its own) or all of them.
    """

    replay: torch.Tensor | None = None
    record: bool = False
    recorded: list[torch.Tensor] = field(default_factory=list)
    counted: torch.Tensor | None = None
    tally: RouterTally = field(default_factory=RouterTally)

    @property
    def num_disagree(self) -> torch.Tensor | int:
        return self.tally.disagree

    @property
    def num_pairs(self) -> torch.Tensor | int:
        return self.tally.pairs

    def stacked(self) -> torch.Tensor:
        """Recorded routes as ``[N, num_moe_layers, top_k]``."""
        return torch.stack(self.recorded, dim=1)


@dataclass
class ForwardContext:
    """Everything a forward pass needs besides tokens and positions."""

    attn: nn.Module  # PackedCausalAttention | PagedAttention: forward(layer_idx, q, k, v, scale)
    routing: RoutingContext | None = None
    position_ids: torch.Tensor | None = None  # [B, T] of the tokens; CausalLM.hidden_states fills it in
    # DSA: each indexer layer's top-k choice, by layer, for the "shared" layers after it. Keyed by
    # layer (not "the last one") so that recomputing a block under activation checkpointing reads
    # the same choice as its forward did.
    dsa_selection: dict = field(default_factory=dict)
    # DSA on shared-prompt rows: each row's key layout (rlcli.ops.mla.tree_key_layout), by row,
    # built once per forward for every indexer layer.
    dsa_layouts: dict = field(default_factory=dict)
