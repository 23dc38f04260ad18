"""Causal attention over packed rows with document masks, never building a [T, T] mask.

A training row packs several sequences (documents); a document starts where
``position_ids == 0``. Query ``i`` sees key ``j`` iff both are in the same document and
``j <= i``. The dense ``[B, T, T]`` boolean mask this replaces costs 16 GiB per row at
131k tokens and rules out flash kernels; the backends here only ever hold per-document
or per-block state:

* ``sdpa`` (CPU, and the reference): without context parallelism, the documents
  (segments) of all rows in a few padded SDPA calls per layer, bucketed by length
  (:func:`rlcli.ops.prefix_tree.attention_buckets`); under CP one SDPA call per document.
  Memory is O(doc²) per document, not O(T²). Works everywhere, with autograd.
* ``flex`` (CUDA): FlexAttention (compiled) with a block mask built from document ids.
  Fully masked blocks are skipped. It is compiled whole (``fullgraph``): uncompiled,
  ``flex_attention`` runs an unfused implementation that materializes the ``[T, S]`` scores
  (32 GiB per layer for a 32k row at 16 heads under --cp 2), so where torch.compile would give
  up on it (its recompile limit, a graph break) it raises instead of silently taking that path.
  On CPU FlexAttention has no backward (torch 2.13), so there it is used only without grad
  (tests check it against the dense mask).
* ``varlen`` (CUDA, no CP): ``torch.nn.attention.varlen.varlen_attn`` (flash) over
  ``cu_seqlens`` of all documents of the batch flattened; fp32 inputs take ``sdpa``.
* ``cudnn``: one causal SDPA call per document with cuDNN's kernel first in SDPA's
  priority (on Hopper it is faster than the FA2 kernels behind ``varlen``; SDPA falls back
  to flash or its CPU kernels where cuDNN does not apply). Each document's q/k/v are
  sliced so that they keep the ``[B, S, H, D]`` memory layout cuDNN requires; when this
  torch's cuDNN path has no grouped-query support, K/V heads are repeated first. Shared
  prompts and CP queries take the ``sdpa`` code under the same priority. It runs outside
  ``torch.compile`` (compiled blocks break their graph around it).

* ``invariant``: the ``sdpa`` code with each call replaced by
  :func:`rlcli.ops.batch_invariant.invariant_attention` (fixed key blocks, fixed summation
  order): the engine's paged attention under ``model.batch_invariant`` gives the same bits.
  fp32 math, with autograd; slower than the kernels (it builds every score). On CUDA
  (without CP) every segment of the batch goes through one call of the invariant Triton
  kernel per layer instead (:class:`_InvariantKernelFn`, the engine's kernel), and the
  backward pass differentiates ``varlen`` (half precision) or the per-document code.

``auto`` picks, on CUDA, ``cudnn`` when every row is one document (where cuDNN's SDPA
kernel applies), ``flex`` under CP and ``varlen`` otherwise; ``sdpa`` elsewhere.

Shared prompts (:mod:`rlcli.ops.prefix_tree`): a row may be a prefix tree of segments
instead of independent documents; a segment then also sees its ancestors' segments.
``sdpa`` attends each segment over its ancestors' keys and its own (a bool mask: all of
the ancestors, causal within its own), batched as above; ``flex`` uses the tree's mask
``k <= q < reach[k]``; ``varlen`` gives each segment its own key sequence, its ancestors'
keys and values gathered in front of its own (one gather per layer, :class:`_GatherRows`,
whose backward sums each shared token's copies without atomics), with flash's causal mask aligned to
the bottom right: a completion's queries see the whole prompt and their own past, and
the prompt's tokens are computed once, at flash speed.

Context parallelism (``rlcli.parallel.context``) gives each rank a subset of the row's
queries, ``query_index_T`` (global indices into the row), while keys and values are the
whole row (all-gathered per layer). The document structure is computed once per forward,
on the host, from the full row's position ids; all layers share it.
"""

import functools
import inspect
import warnings
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlcli.ops.batch_invariant import invariant_attention, invariant_kernels, on_kernels
from rlcli.ops.prefix_tree import RowTree, attention_buckets

AttentionBackend = Literal["auto", "sdpa", "flex", "varlen", "cudnn", "invariant"]


def _sdpa(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, scale: float,
          mask=None, is_causal: bool = False) -> torch.Tensor:
    gqa = q_BHTD.shape[1] != k_BHSD.shape[1]
    if gqa and q_BHTD.is_cuda and q_BHTD.dtype == torch.float32:
        # CUDA's flash kernels take no fp32 and its memory-efficient kernel no grouped heads, so
        # SDPA would fall back to its math path (the scores materialized, ~10 kernels a call):
        # repeat the K/V heads instead and let the memory-efficient kernel run.
        rep = q_BHTD.shape[1] // k_BHSD.shape[1]
        k_BHSD, v_BHSD = k_BHSD.repeat_interleave(rep, dim=1), v_BHSD.repeat_interleave(rep, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=mask, is_causal=is_causal,
                                          scale=scale, enable_gqa=gqa)


def doc_ids_from_positions(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Sequence index of every token in a packed row: a new sequence starts at position 0."""
    return torch.cumsum((position_ids_BT == 0).to(torch.int32), dim=-1)


@functools.cache
def _cudnn_gqa(device: torch.device) -> bool:
    """Whether SDPA's cuDNN kernel takes fewer K/V heads than query heads on ``device``
    (probed once on tiny tensors; off CUDA SDPA's own kernels do)."""
    if device.type != "cuda":
        return True
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

    q = torch.empty(1, 128, 4, 64, device=device, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.empty(1, 128, 2, 64, device=device, dtype=torch.bfloat16).transpose(1, 2)
    try:
        return bool(can_use_cudnn_attention(SDPAParams(q, k, k, None, 0.0, True, True)))
    except (RuntimeError, TypeError):
        return False


@functools.cache
def _cudnn_usable(device: torch.device) -> bool:
    """Whether SDPA's cuDNN kernel runs causal bf16 attention on ``device`` (probed once)."""
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

    q = torch.empty(1, 128, 4, 64, device=device, dtype=torch.bfloat16).transpose(1, 2)
    try:
        return bool(can_use_cudnn_attention(SDPAParams(q, q, q, None, 0.0, True, False)))
    except (RuntimeError, TypeError):
        return False


def _cudnn_first_kwargs() -> dict:
    """``sdpa_kernel`` arguments that put cuDNN first (a torch without ``set_priority`` only
    enables the backends, in its own order). Read outside compiled code: the result is baked in."""
    return {"set_priority": True} if "set_priority" in inspect.signature(sdpa_kernel).parameters else {}


_CUDNN_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def flex_kernel_options(head_dim: int) -> dict | None:
    """FlexAttention options for the head size (None: torch's defaults). Triton pads a head
    dim above 128 (MLA's 192 = 128 + 64 rope) to 256, and torch's Hopper default for it (3
    pipeline stages of 64 x 64 blocks) needed 273 KiB of shared memory with fp32 inputs, beyond
    the H200's 227 KiB: two stages fit. bf16 tiles take half as much; two stages are kept for
    them too (not measured with three)."""
    return {"fwd_num_stages": 2} if head_dim > 128 else None


@functools.cache
def _compiled_flex():
    """FlexAttention compiled whole (module docstring: fullgraph, never the unfused path). Row lengths
    vary: dynamo goes dynamic after the first shape."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, fullgraph=True)


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_params() -> frozenset[str]:
    """Keyword names of this torch's varlen_attn (2.10: is_causal, no scale; 2.12+: scale,
    window_size, enable_gqa)."""
    return frozenset(inspect.signature(_varlen_attn()).parameters)


class PackedCausalAttention(nn.Module):
    """Causal attention within the documents of packed rows (see module docstring).

    ``position_ids_BT`` are the positions of the full rows (the keys). ``query_index_T``
    lists which of the row's tokens this rank holds as queries (context parallelism;
    default: all, in order); it is the same for every row. ``device`` is where q/k/v
    live (default: where the positions are): pass host positions and the GPU so that
    reading the document boundaries costs no device sync. ``trees`` (one
    :class:`~rlcli.ops.prefix_tree.RowTree` per row) gives the segments of shared-prompt
    rows; without it a document starts at position 0.
    """

    def __init__(self, position_ids_BT: torch.Tensor, backend: AttentionBackend = "auto",
                 query_index_T: torch.Tensor | None = None, device: torch.device | str | None = None,
                 trees: list[RowTree] | None = None):
        super().__init__()
        device = torch.device(device) if device is not None else position_ids_BT.device
        B, T = position_ids_BT.shape
        if trees is None:  # document boundaries are host-side metadata, read once per forward for all layers
            trees = [RowTree.from_positions(row) for row in position_ids_BT.detach().cpu().numpy()]
        assert len(trees) == B and all(t.num_tokens == T for t in trees), ([t.num_tokens for t in trees], B, T)
        self.trees = trees
        self.num_keys = T
        self.query_index = None if query_index_T is None else query_index_T.detach().cpu().long()
        self.shared = any(t.shared for t in trees)
        # Per row: (start, end, ancestor key spans) of every segment.
        self.spans = [[(s, e, _merged(t.ancestors(j))) for j, (s, e) in enumerate(t.spans)] for t in trees]
        self.backend = self._resolve(backend, device)
        self.device = device
        self.query_runs = self._query_runs()
        self._block_mask = None
        self._varlen_plan = None
        self._invariant_plan = None
        self._batched_plan = None
        self.expand_kv = self.backend == "cudnn" and not _cudnn_gqa(device)
        self.sdpa_kwargs = _cudnn_first_kwargs() if self.backend == "cudnn" else {}
        if self.backend == "flex":
            self.reach_BT = torch.from_numpy(np.stack([t.reach() for t in trees])).to(device)

    def _resolve(self, backend: AttentionBackend, device: torch.device) -> str:
        if backend == "auto":
            if device.type != "cuda":
                return "sdpa"
            if self.query_index is not None:
                return "flex"
            if not self.shared and all(len(t.spans) == 1 for t in self.trees) and _cudnn_usable(device):
                return "cudnn"  # rows of one document each: cuDNN's kernel (faster than FA2 on Hopper)
            return "varlen" if _varlen_attn() is not None else "flex"
        if backend == "varlen" and (self.query_index is not None or _varlen_attn() is None):
            raise ValueError("the varlen attention backend needs torch.nn.attention.varlen and no context "
                             "parallelism; set train.attention to auto, flex, cudnn or sdpa")
        return backend

    def _query_runs(self) -> list[tuple[int, int, int]]:
        """Contiguous runs of this rank's queries: (global start, global end, local start)."""
        if self.query_index is None:
            return [(0, self.num_keys, 0)]
        idx = self.query_index.tolist()
        runs = []
        for i, g in enumerate(idx):
            if i == 0 or g != idx[i - 1] + 1:
                runs.append([g, g + 1, i])
            else:
                runs[-1][1] = g + 1
        return [tuple(r) for r in runs]

    @property
    def in_graph(self) -> bool:
        """Whether a compiled block may trace this attention (:class:`rlcli.ops.attention.InnerAttention`).
        Only ``flex``: the other backends plan on the host over this batch's segments (Python loops,
        tensors built from lists), which dynamo would trace into the block's graph, guard on, and
        trace again for every new document structure, i.e. at every RL step (and on a CPU with
        shared-prompt rows inductor generated a mask kernel g++ rejected)."""
        return self.backend == "flex"

    def forward(self, layer_idx: int, q_BTHD: torch.Tensor, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor,
                scale: float) -> torch.Tensor:
        assert k_BSHD.shape[1] == self.num_keys, (k_BSHD.shape, self.num_keys)
        if self.backend == "flex":
            return self._flex(q_BTHD, k_BSHD, v_BSHD, scale)
        if self.backend == "varlen" and q_BTHD.dtype in (torch.float16, torch.bfloat16):  # flash: half only
            return self._varlen(q_BTHD, k_BSHD, v_BSHD, scale)
        if self.backend == "cudnn":
            return self._cudnn(q_BTHD, k_BSHD, v_BSHD, scale)
        if self.backend in ("sdpa", "varlen") and self.query_index is None:  # varlen here: fp32 inputs
            return self._sdpa_batched(q_BTHD, k_BSHD, v_BSHD, scale)
        if self.backend == "invariant" and self.query_index is None and on_kernels(q_BTHD):
            return _InvariantKernelFn.apply(q_BTHD, k_BSHD, v_BSHD, float(scale), self)
        return self._sdpa_per_document(q_BTHD, k_BSHD, v_BSHD, scale)

    @torch.compiler.disable
    def _cudnn(self, q_BTHD, k_BSHD, v_BSHD, scale) -> torch.Tensor:
        # Outside compiled blocks (a graph break around attention): SDPA's backend choice under
        # sdpa_kernel is then the eager dispatcher's, whatever this torch's dynamo makes of it.
        with sdpa_kernel(_CUDNN_ORDER, **self.sdpa_kwargs):
            if self.shared or self.query_index is not None:
                return self._sdpa_per_document(q_BTHD, k_BSHD, v_BSHD, scale)
            return self._cudnn_per_document(q_BTHD, k_BSHD, v_BSHD, scale)

    # ------------------------------------------------------------------ cuDNN, one call per document
    def _cudnn_per_document(self, q_BTHD, k_BSHD, v_BSHD, scale) -> torch.Tensor:
        """Independent documents, all queries: per document ``x[b, s:e][None]`` keeps the
        [1, S, H, D] strides cuDNN's layout check wants (a slice of the batched view would not)."""
        if self.expand_kv and q_BTHD.shape[2] != k_BSHD.shape[2]:
            rep = q_BTHD.shape[2] // k_BSHD.shape[2]
            k_BSHD, v_BSHD = k_BSHD.repeat_interleave(rep, dim=2), v_BSHD.repeat_interleave(rep, dim=2)
        rows = []
        for b, spans in enumerate(self.spans):
            pieces = [_sdpa(*(x[b, s:e][None].transpose(1, 2) for x in (q_BTHD, k_BSHD, v_BSHD)), scale,
                            is_causal=True).transpose(1, 2) for s, e, _ in spans]
            rows.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1))
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)

    # ------------------------------------------------------------------ sdpa, one call per document
    def _sdpa_per_document(self, q_BTHD, k_BSHD, v_BSHD, scale) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BSHD, v_BSHD))
        runs = self.query_runs
        rows = []
        for b, spans in enumerate(self.spans):
            pieces = []
            for qs, qe, local in runs:
                for ds, de, prefix in spans:
                    s, e = max(ds, qs), min(de, qe)
                    if s >= e:
                        continue
                    # Queries s..e-1 see their ancestors' keys and keys ds..(their own index):
                    # bottom-right aligned causal on the own part.
                    q_i = q[b:b + 1, :, local + s - qs:local + e - qs]
                    key_spans = prefix + [(ds, e)]
                    if prefix and prefix[-1][1] == ds:  # contiguous with the parent: one slice
                        key_spans = prefix[:-1] + [(prefix[-1][0], e)]
                    k_i = torch.cat([k[b:b + 1, :, a:z] for a, z in key_spans], dim=2) if len(key_spans) > 1 \
                        else k[b:b + 1, :, key_spans[0][0]:e]
                    v_i = torch.cat([v[b:b + 1, :, a:z] for a, z in key_spans], dim=2) if len(key_spans) > 1 \
                        else v[b:b + 1, :, key_spans[0][0]:e]
                    t, n = e - s, k_i.shape[2]
                    if self.backend == "invariant":  # the same bottom-right causal rule
                        pieces.append(invariant_attention(q_i, k_i, v_i, scale))
                    elif t == n:
                        pieces.append(_sdpa(q_i, k_i, v_i, scale, is_causal=True))
                    else:
                        mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(diagonal=n - t)
                        pieces.append(_sdpa(q_i, k_i, v_i, scale, mask=mask))
            rows.append(torch.cat(pieces, dim=2))
        return torch.cat(rows, dim=0).transpose(1, 2)

    # ------------------------------------------------------------------ sdpa, segments batched (no CP)
    def _plan_batched(self, device: torch.device):
        """Once per forward, shared by every layer: the padded buckets of all segments
        (:func:`rlcli.ops.prefix_tree.attention_buckets`) as gathers, and the gather that puts
        the outputs back in row order."""
        if self._batched_plan is None:
            buckets, source = attention_buckets(self.trees)
            plans = []
            for bk in buckets:
                mask = None if bk.mask is None else torch.from_numpy(bk.mask).to(device)
                plans.append((bk.n, bk.Lq, bk.Lk, _GatherPlan(bk.query_index, device),
                              _GatherPlan(bk.key_index, device), mask))
            self._batched_plan = (plans, _GatherPlan(source, device))
        return self._batched_plan

    def _sdpa_batched(self, q_BTHD, k_BSHD, v_BSHD, scale) -> torch.Tensor:
        """All queries (no context parallelism): a few padded SDPA calls per layer instead
        of one per segment. Gathers (:class:`_GatherRows`) build each bucket's queries and
        keys; their backward sums the copies of a shared prompt's keys without atomics. A
        masked key slot gets probability 0, so padding adds exact zeros to the outputs and
        to every gradient."""
        B, T, Hq, _ = q_BTHD.shape
        plans, back = self._plan_batched(q_BTHD.device)
        q, k, v = q_BTHD.flatten(0, 1), k_BSHD.flatten(0, 1), v_BSHD.flatten(0, 1)
        outs = []
        for n, Lq, Lk, q_plan, k_plan, mask in plans:
            (q_b,) = _GatherRows.apply(q_plan, q)
            k_b, v_b = _GatherRows.apply(k_plan, k, v)
            q_b, k_b, v_b = (x.view(n, L, *x.shape[1:]).transpose(1, 2) for x, L in ((q_b, Lq), (k_b, Lk), (v_b, Lk)))
            out = _sdpa(q_b, k_b, v_b, scale, mask=mask, is_causal=mask is None)
            outs.append(out.transpose(1, 2).reshape(n * Lq, Hq, out.shape[-1]))
        (out,) = _GatherRows.apply(back, outs[0] if len(outs) == 1 else torch.cat(outs))
        return out.view(B, T, Hq, out.shape[-1])

    # ------------------------------------------------------------------ FlexAttention
    def block_mask(self):
        """The FlexAttention block mask of this batch, built once and shared by all layers."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            reach = self.reach_BT
            B, S = reach.shape
            q_index = (torch.arange(S) if self.query_index is None else self.query_index).to(self.device)

            def tree_causal(b, h, qi, ki):  # documents and prefix trees alike (rlcli.ops.prefix_tree)
                g = q_index[qi]
                return (ki <= g) & (g < reach[b, ki])

            # Compiled on CUDA: the eager version evaluates the mask over all T x S pairs at once.
            self._block_mask = create_block_mask(tree_causal, B, None, q_index.numel(), S, device=self.device,
                                                 _compile=self.device.type == "cuda")
        return self._block_mask

    def _flex(self, q_BTHD, k_BSHD, v_BSHD, scale) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BSHD, v_BSHD))
        gqa = q.shape[1] != k.shape[1]
        if q.device.type == "cuda":
            out = _compiled_flex()(q, k, v, block_mask=self.block_mask(), scale=scale, enable_gqa=gqa,
                                   kernel_options=flex_kernel_options(q.shape[-1]))
        else:  # unfused (materializes scores): CPU tests only
            from torch.nn.attention.flex_attention import flex_attention
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                out = flex_attention(q, k, v, block_mask=self.block_mask(), scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)

    # ------------------------------------------------------------------ varlen (flash)
    def _segment_keys(self, T: int) -> tuple[list[int], list[int], np.ndarray, int, int]:
        """Host-side: query and key ``cu_seqlens`` of every segment in the flattened batch, the
        row of each segment's keys (its ancestors' spans first, then its own), and the maxima."""
        cu_q, cu_k, index = [0], [0], []
        for b, spans in enumerate(self.spans):
            for s, e, prefix in spans:
                cu_q.append(b * T + e)
                keys = prefix + [(s, e)]
                cu_k.append(cu_k[-1] + sum(z - a for a, z in keys))
                index += [np.arange(b * T + a, b * T + z) for a, z in keys]
        max_q = max(e - s for spans in self.spans for s, e, _ in spans)
        max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
        return cu_q, cu_k, np.concatenate(index), max_q, max_k

    def _plan_varlen(self, T: int, device: torch.device):
        """Once per forward, shared by every layer: query and key ``cu_seqlens``, their
        maxima, and (shared-prompt rows only) the index of each segment's keys in the
        flattened batch, its ancestors' spans first."""
        if self._varlen_plan is None:
            cu_q, cu_k, index, max_q, max_k = self._segment_keys(T)
            as_dev = lambda x: torch.tensor(x, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
            gather = _GatherPlan(index, device) if self.shared else None
            self._varlen_plan = (as_dev(cu_q), as_dev(cu_k) if self.shared else None, max_q, max_k, gather)
        return self._varlen_plan

    def _plan_invariant(self, T: int, device: torch.device):
        """:meth:`_plan_varlen` for the invariant kernel (key rows always, int64), once per forward."""
        if self._invariant_plan is None:
            cu_q, cu_k, index, max_q, _ = self._segment_keys(T)
            as_dev = lambda x: torch.as_tensor(x, dtype=torch.int64).to(device, non_blocking=True)  # noqa: E731
            self._invariant_plan = (as_dev(index), as_dev(cu_q), as_dev(cu_k), max_q)
        return self._invariant_plan

    def _differentiable(self, q_BTHD, k_BSHD, v_BSHD, scale) -> torch.Tensor:
        """The invariant backend's attention by kernels with a backward (flash varlen in half
        precision, else the per-document code): :class:`_InvariantKernelFn`'s backward pass."""
        if q_BTHD.is_cuda and q_BTHD.dtype in (torch.float16, torch.bfloat16) and _varlen_attn() is not None:
            return self._varlen(q_BTHD, k_BSHD, v_BSHD, scale)
        return self._sdpa_per_document(q_BTHD, k_BSHD, v_BSHD, scale)

    def _varlen(self, q_BTHD, k_BSHD, v_BSHD, scale) -> torch.Tensor:
        B, T = q_BTHD.shape[:2]
        cu_q, cu_k, max_q, max_k, gather = self._plan_varlen(T, q_BTHD.device)
        pad = q_BTHD.shape[-1] - v_BSHD.shape[-1]
        if pad > 0:  # flash needs one head size for q, k and v (MLA: 192 vs 128): pad v, cut the output
            v_BSHD = torch.nn.functional.pad(v_BSHD, (0, pad))
        k, v = k_BSHD.flatten(0, 1), v_BSHD.flatten(0, 1)
        if gather is not None:  # shared prompts: each segment's ancestors' keys in front of its own
            k, v = _GatherRows.apply(gather, k, v)
        out = varlen_attention(q_BTHD.flatten(0, 1), k, v, cu_q, cu_q if cu_k is None else cu_k, max_q, max_k, scale)
        out = out.view(B, T, *out.shape[1:])
        return out[..., :out.shape[-1] - pad] if pad > 0 else out


class _InvariantKernelFn(torch.autograd.Function):
    """The ``invariant`` backend on CUDA: the forward is one call of the invariant attention kernel
    over every segment of the batch (:mod:`rlcli.ops.invariant_kernels`, the engine's kernel);
    the backward differentiates :meth:`PackedCausalAttention._differentiable` (a gradient need
    not be batch-invariant)."""

    @staticmethod
    def forward(ctx, q_BTHD, k_BSHD, v_BSHD, scale: float, attn: "PackedCausalAttention"):
        ctx.save_for_backward(q_BTHD, k_BSHD, v_BSHD)
        ctx.scale, ctx.attn = scale, attn
        B, T, Hq = q_BTHD.shape[:3]
        rows, cu_q, cu_k, max_q = attn._plan_invariant(T, q_BTHD.device)
        out = invariant_kernels().attention(q_BTHD.flatten(0, 1), k_BSHD.flatten(0, 1), v_BSHD.flatten(0, 1), rows,
                                            cu_q, cu_k, max_q, scale)
        return out.view(B, T, Hq, -1)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
            out = ctx.attn._differentiable(qd, kd, vd, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), dout)
        return dq, dk, dv, None, None


def varlen_attention(q_NHD: torch.Tensor, k_MHD: torch.Tensor, v_MHD: torch.Tensor, cu_q: torch.Tensor,
                  cu_k: torch.Tensor, max_q: int, max_k: int, scale: float, causal: bool = True) -> torch.Tensor:
    """Flash varlen attention of sequences flattened along dim 0 (sequence ``i``: queries
    ``cu_q[i]:cu_q[i+1]``, keys ``cu_k[i]:cu_k[i+1]``), causal aligned to the bottom right:
    a sequence's last query sees all of its keys, so a chunk of queries after cached keys, or
    one decode query, needs no mask (``causal=False``: every query sees all of its keys). Grouped K/V heads and the softmax scale are passed the
    way this torch's ``varlen_attn`` takes them (torch 2.10 has neither argument: heads are
    repeated and the scale folded into ``q``)."""
    params = _varlen_params()
    window = (-1, 0) if causal else (-1, -1)
    mask = {"window_size": window} if "window_size" in params else {"is_causal": causal}
    gqa = {}
    if q_NHD.shape[1] != k_MHD.shape[1]:
        if "enable_gqa" in params:
            gqa = {"enable_gqa": True}
        elif not _varlen_takes_grouped_heads(q_NHD.device, torch.is_grad_enabled() and (
                q_NHD.requires_grad or k_MHD.requires_grad or v_MHD.requires_grad)):
            rep = q_NHD.shape[1] // k_MHD.shape[1]
            k_MHD, v_MHD = k_MHD.repeat_interleave(rep, dim=1), v_MHD.repeat_interleave(rep, dim=1)
    if "scale" in params:
        extra = {"scale": scale}
    else:  # fold ours into q over the default 1/sqrt(D)
        extra, q_NHD = {}, q_NHD * (scale * q_NHD.shape[-1] ** 0.5)
    return _varlen_attn()(q_NHD, k_MHD, v_MHD, cu_q, cu_k, max_q, max_k, **extra, **mask, **gqa)


@functools.cache
def _varlen_takes_grouped_heads(device: torch.device, backward: bool = False) -> bool:
    """Whether this torch's ``varlen_attn``, lacking an ``enable_gqa`` argument, still takes
    fewer K/V heads than query heads (flash's kernel reads each K/V head for its group of
    query heads) and gives what repeated heads give, with ``backward`` also the gradients
    (those of K and V summed over each group): probed once on tiny tensors. Repeating the
    heads instead copies K and V once per group, which in the engine's decode step cost more
    device time than the attention itself."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(6, 4, 64, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(6, 2, 64, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    varlen_attn = _varlen_attn()
    with torch.enable_grad():
        leaves = [x.clone().requires_grad_(backward) for x in (q, k, v, q, k, v)]
        try:
            grouped = varlen_attn(*leaves[:3], cu, cu, 4, 4)
            if backward:
                grouped.float().square().sum().backward()
        except (RuntimeError, ValueError):
            return False
        qr, kr, vr = leaves[3], leaves[4].repeat_interleave(2, dim=1), leaves[5].repeat_interleave(2, dim=1)
        repeated = varlen_attn(qr, kr, vr, cu, cu, 4, 4)
        if not torch.equal(grouped, repeated):
            return False
        if not backward:
            return True
        repeated.float().square().sum().backward()
    return all(a.grad is not None and a.grad.shape == b.grad.shape and torch.allclose(a.grad, b.grad, atol=1e-2, rtol=0)
               for a, b in zip(leaves[:3], leaves[3:]))


class _GatherPlan:
    """A row gather ``x[index]`` and its transpose, built once per forward on the host: the
    gathered positions of each source row, sorted next to each other and grouped by copy
    count (1 for a completion's own tokens, the group size for a prompt's)."""

    def __init__(self, index: np.ndarray, device: torch.device):
        self.index = torch.from_numpy(index).to(device, non_blocking=True)
        order = np.argsort(index, kind="stable")
        dest, first, count = np.unique(index[order], return_index=True, return_counts=True)
        self.runs = []  # (copies, gathered positions [n * copies], source rows [n])
        for c in np.unique(count).tolist():
            sel = count == c
            pos = order[(first[sel][:, None] + np.arange(c)).ravel()]
            self.runs.append((c, torch.from_numpy(pos).to(device, non_blocking=True),
                              torch.from_numpy(dest[sel]).to(device, non_blocking=True)))


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, plan.index)`` for each input. Autograd's backward of that is an
    ``index_add_`` whose duplicate indices (every completion of a group gathers the same
    prompt rows) serialize on atomic adds; this one gathers each source row's copies next to
    each other and sums them with a reshape per copy count, then writes every source row
    once: no atomics, deterministic, accumulated in fp32 by the sum."""

    @staticmethod
    def forward(ctx, plan: _GatherPlan, *xs: torch.Tensor):
        ctx.plan, ctx.shapes = plan, [x.shape for x in xs]
        return tuple(x.index_select(0, plan.index) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        out = []
        for g, shape in zip(grads, ctx.shapes):
            if g is None:
                out.append(None)
                continue
            g = g.contiguous()
            gx = g.new_zeros(shape)  # rows no segment reads (padding) get no gradient
            for copies, pos, dest in ctx.plan.runs:
                part = g.index_select(0, pos)
                if copies > 1:
                    part = part.view(-1, copies, *g.shape[1:]).sum(1)
                gx.index_copy_(0, dest, part)
            out.append(gx)
        return (None, *out)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent spans joined (fewer key slices to concatenate)."""
    out: list[tuple[int, int]] = []
    for a, z in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], z)
        else:
            out.append((a, z))
    return out
