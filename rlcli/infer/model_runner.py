"""The native engine's model side: its paged KV cache, a step's inputs on the device, the forward
pass, the decode kernel's warm-up and the decode steps' CUDA graphs.

:class:`rlcli.infer.engine.NativeEngine` schedules, samples and keeps the books; each step it hands
the runner its (sequence, tokens) pairs and gets the logits back. The runner owns what a faster
device path changes: how inputs reach the device (one host array, one copy), which attention path
each layer takes (:class:`~rlcli.ops.attention.PagedAttention`), and whether the forward is replayed
as a graph (:mod:`rlcli.infer.cuda_graphs`).
"""

import logging

import numpy as np
import torch

from rlcli.infer.cuda_graphs import DecodeGraphs, unsupported
from rlcli.infer.fused_layers import fuse_layers
from rlcli.models import CausalLM
from rlcli.ops.attention import _PAGED_ON_CPU, ForwardContext, PagedAttention, PagedAttentionMetadata, RoutingContext
from rlcli.ops.batch_invariant import batch_invariant_setup, make_batch_invariant
from rlcli.ops.sampling import sample

log = logging.getLogger("rlcli.rl-infer")  # rl-infer's (rlcli.logging.setup_logging)


class ModelRunner:
    """``model`` (in eval mode) with a paged KV cache of ``kv_cache_memory_mb``: ``num_blocks``
    blocks for the engine's block manager, and with graphs one more, their padding rows' scratch
    block. ``batch_invariant`` makes the model's numerics batch-invariant; ``paged_decode``,
    ``cuda_graphs`` and ``fused_kernels`` are ``infer.engine``'s."""

    def __init__(self, model: CausalLM, *, max_model_len: int, block_size: int, kv_cache_memory_mb: float,
                 max_num_seqs: int, role: str, batch_invariant: bool, paged_decode: bool, cuda_graphs: bool,
                 fused_kernels: bool = True):
        self.model = model.eval()
        self.batch_invariant = batch_invariant
        self.paged_decode = paged_decode  # decodes through rlcli.ops.paged_decode on CUDA
        if batch_invariant:
            batch_invariant_setup(next(model.parameters()).device)
            make_batch_invariant(model)
        self.device = next(model.parameters()).device
        # The elementwise work in fused kernels (rlcli.infer.fused_layers), or why not.
        self.fused_off = ("off (infer.engine.fused_kernels)" if not fused_kernels else
                          "model.batch_invariant has kernels of its own" if batch_invariant else
                          "not on CUDA" if not (self.device.type == "cuda" or _PAGED_ON_CPU) else
                          fuse_layers(model))
        self.dtype = next(model.parameters()).dtype
        self.max_model_len, self.block_size, self.max_num_seqs = max_model_len, block_size, max_num_seqs
        spec = model.kv_cache_spec()  # per layer: (heads, dim) of each cache tensor (K, V or MLA latent, ...)
        bytes_per_block = block_size * sum(h * d for layer in spec for h, d in layer) * self.dtype.itemsize
        self.num_blocks = max(int(kv_cache_memory_mb * 2**20 // bytes_per_block), 2)
        # Decode steps replayed as CUDA graphs, or why not.
        self.graphs: DecodeGraphs | None = None
        self.graphs_off = ("off (infer.engine.cuda_graphs)" if not cuda_graphs else
                           "not on CUDA" if self.device.type != "cuda" else
                           unsupported(model, paged_decode=paged_decode, batch_invariant=batch_invariant, role=role))
        self.graph_steps = 0
        self.kv_caches = [tuple(torch.zeros(self.num_blocks + (self.graphs_off is None), block_size, h, d,
                                            dtype=self.dtype, device=self.device) for h, d in layer) for layer in spec]

    def capture_graphs(self) -> None:
        """Capture the decode graphs (after :meth:`warm_up`), unless ``graphs_off`` says why not. A
        capture that fails (an operation a graph cannot hold, on a path :func:`unsupported` let through)
        is logged, and the engine decodes eagerly, ``graphs_off`` naming the error."""
        if self.graphs_off is None:
            graphs = DecodeGraphs(self.model, self.kv_caches, block_size=self.block_size,
                                  max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                                  scratch_block=self.num_blocks)
            try:
                graphs.capture()
            except RuntimeError as e:
                first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                self.graphs_off = f"capture failed: {type(e).__name__}: {first}"
                log.warning("decode graphs: %s; decoding eagerly", self.graphs_off)
                graphs.graphs.clear()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return
            self.graphs = graphs

    def refresh_graphs(self) -> None:
        """After a weight load: capture again if a parameter's storage moved."""
        if self.graphs is not None:
            self.graphs.refresh()

    @property
    def decode_mode(self) -> str:
        """How decode steps run: replayed graphs, or eagerly and why; with the fused kernels, or
        without and why."""
        g = self.graphs
        fused = "fused kernels" if self.fused_off is None else f"unfused ({self.fused_off})"
        if g is None:
            return f"eager ({self.graphs_off}), {fused}"
        return (f"CUDA graphs at {len(g.sizes)} batch sizes up to {g.max_size} ({len(g.graphs)} graphs with the "
                f"span counts, captured in {g.capture_s:.1f}s), {fused}")

    def close(self) -> None:
        self.graphs = None
        self.kv_caches = []

    @torch.no_grad()
    def warm_up(self) -> None:
        """Decode one token through the model at each of the paged decode kernel's
        ``WARM_UP_CONTEXTS`` that ``max_model_len`` holds, so Triton compiles the decode path's
        kernels here (on CUDA, at construction) and not inside the first requests' steps, where
        each compile held up the whole step (the three took 2.1-2.8 s on an H100 with an empty Triton
        cache; bench/engine_warm_up.py), and samples from the last logits once (the sampling kernel).
        Every position reads block 0, and the one slot written is zeroed again, so it runs only while
        every block is free (:meth:`NativeEngine.warm_up` checks). Without Triton, one decode at a
        context of 1."""
        try:
            from rlcli.ops import paged_decode
            contexts = paged_decode.WARM_UP_CONTEXTS
        except (ImportError, OSError):
            contexts = (1,)
        for n in (n for n in contexts if n <= self.max_model_len):
            width = -(-n // self.block_size)
            host = np.zeros(3 + width, dtype=np.int64)  # token 0 | position n - 1 | slot 0 | a table of block 0s
            host[1] = n - 1
            inputs = torch.from_numpy(host).to(self.device)
            meta = PagedAttentionMetadata(slot_mapping=inputs[2:3], query_start=[0, 1], context_lens=[n],
                                          block_tables=inputs[3:].view(1, width), block_size=self.block_size,
                                          num_decode=1, block_tables_host=host[3:].reshape(1, width))
            ctx = ForwardContext(attn=PagedAttention(self.kv_caches, meta, self.batch_invariant, self.paged_decode))
            logits = self.model.lm_head(self.model.hidden_states(inputs[None, :1], inputs[None, 1:2], ctx)[0])
        ones = torch.ones(1, device=self.device)
        sample(logits, ones, ones, any_top_p=False, greedy_rows="none",  # the sampling kernel's compile, likewise
               kernel=self.fused_off is None)
        for layer in self.kv_caches:
            for cache in layer:
                cache[0].zero_()

    # ------------------------------------------------------------------ forward
    def _rows(self, batch: list) -> tuple[list, list[int], list[int]]:
        """A step's (ids, positions, slots) parts in batch order (runs of decodes as lists, prefill
        chunks as arrays), its query starts and its context lengths."""
        bs = self.block_size
        if all(n == 1 for _, n in batch):  # one token each (most steps): one part, by comprehension
            seqs = [seq for seq, _ in batch]
            starts = [seq.num_computed for seq in seqs]
            return ([([seq.tokens[p] for seq, p in zip(seqs, starts)], starts,
                      [seq.blocks[p // bs] * bs + p % bs for seq, p in zip(seqs, starts)])],
                    list(range(len(batch) + 1)), [p + 1 for p in starts])
        ids, pos, slots, qstart, ctx_lens = [], [], [], [0], []
        parts = []
        for seq, n in batch:
            start = seq.num_computed
            if n == 1:  # a decode: no slices or arrays
                ids.append(seq.tokens[start])
                pos.append(start)
                slots.append(seq.blocks[start // bs] * bs + start % bs)
            else:  # a prefill chunk: its positions and slots computed as arrays, not token by token
                if ids:
                    parts.append((ids, pos, slots))
                    ids, pos, slots = [], [], []
                p = np.arange(start, start + n)
                parts.append((seq.tokens[start:start + n], p, np.asarray(seq.blocks)[p // bs] * bs + p % bs))
            qstart.append(qstart[-1] + n)
            ctx_lens.append(start + n)
        if ids:
            parts.append((ids, pos, slots))
        return parts, qstart, ctx_lens

    def forward(self, batch: list, record: bool, keep: list[int] | None = None):
        """One step's forward: ``batch`` is its (sequence, tokens) pairs in order, each sequence's
        ``tokens[num_computed:num_computed + n]`` computed into its ``blocks``; the logits after each
        sequence's last token ``[S, V]``, and with ``record`` the step's routes (MoE). A decode-only
        step replays its graph where there is one. ``keep``: batch indices whose final hidden states
        at every position computed are also returned, as a third item (prompts being scored; such a
        step runs eagerly)."""
        bs, S = self.block_size, len(batch)
        seqs = [seq for seq, _ in batch]
        width = max(len(seq.blocks) for seq in seqs)
        parts, qstart, ctx_lens = self._rows(batch)
        # The step's int64 inputs in one host array, so a GPU gets them in one copy:
        # ids | positions | slots | each sequence's last token | block tables [S, width].
        N = qstart[-1]
        host = np.empty(3 * N + S + S * width, dtype=np.int64)
        q = 0
        for part_ids, part_pos, part_slots in parts:
            k = len(part_ids)
            host[q:q + k], host[N + q:N + q + k], host[2 * N + q:2 * N + q + k] = part_ids, part_pos, part_slots
            q += k
        host[3 * N:3 * N + S] = qstart[1:]
        host[3 * N:3 * N + S] -= 1
        tables = host[3 * N + S:].reshape(S, width)
        tables.fill(-1)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.blocks)] = seq.blocks
        num_decode = 0
        while num_decode < len(batch) and batch[num_decode][1] == 1 and batch[num_decode][0].num_computed > 0:
            num_decode += 1
        if self.graphs is not None and num_decode == S and self.graphs.fits(S) and not keep:
            self.graph_steps += 1
            logits, routes = self.graphs.run(host[:N], host[N:2 * N], host[2 * N:3 * N], ctx_lens, tables)
            return logits, routes if record else None
        inputs = torch.from_numpy(host).to(self.device)
        ids_t, pos_t, slots_t, last = inputs[:3 * N + S].split([N, N, N, S])
        meta = PagedAttentionMetadata(
            slot_mapping=slots_t, query_start=qstart, context_lens=ctx_lens,
            block_tables=inputs[3 * N + S:].view(S, width), block_size=bs, num_decode=num_decode,
            block_tables_host=tables)
        routing = RoutingContext(record=True) if record else None
        ctx = ForwardContext(attn=PagedAttention(self.kv_caches, meta, self.batch_invariant, self.paged_decode),
                             routing=routing)
        hidden = self.model.hidden_states(ids_t[None], pos_t[None], ctx)[0]
        logits = self.model.lm_head(hidden[last])
        routes = routing.stacked() if record else None
        if keep:
            return logits, routes, [hidden[qstart[i]:qstart[i + 1]] for i in keep]
        return logits, routes
