"""CUDA graphs of the native engine's decode-only steps (``infer.engine.cuda_graphs``).

A decode step of a small or mid-sized model on a GPU is bound by the host: every layer launches its
norms, projections, rotary, cache writes and attention from Python, one kernel at a time, while the
device finishes each in microseconds. A graph records one decode forward, embedding to the final norm,
and replays it in one launch; the LM head runs after it, on the step's rows only (one GEMM: graphed,
each size's logits would hold ``size x vocabulary`` of the graphs' memory).

A graph fixes at capture what a step would vary, and each step is fitted to it:

- **Batch size.** Graphs are captured at :func:`capture_sizes` up to ``max_num_seqs`` (at most
  ``MAX_SIZE``; larger steps run eagerly); a step of
  ``S`` decodes replays the smallest size ``>= S``. Its rows past ``S`` are padding: token 0 at
  position 0, written to a scratch block (one KV block past those the block manager hands out,
  :attr:`DecodeGraphs.scratch_block`) and attending to that one key, so they touch no sequence's KV.
- **The decode kernel's spans** (:mod:`rlcli.ops.paged_decode`). One graph per span count, powers
  of two up to what the size uses at ``max_model_len``; a step takes the largest not above the count
  an eager step of its longest context would use. Each sequence cuts its own context into that many
  spans, so the graph is right for any context lengths.
- **Inputs.** Token ids, positions, cache slots and context lengths live in static device buffers,
  refilled by one host-to-device copy per step, and the step's block tables ``[S, width]`` by one
  more (then one device copy into the static ``[max size, max_model_len / block_size]`` table).
- **Weights.** A graph reads the parameters' storage. A weight load that copies in place keeps it;
  one that rebinds a parameter (a collective load's first, onto its arena) changes it, and
  :meth:`DecodeGraphs.refresh` captures the graphs again.
- **FP8 weights** (``infer.fp8``). FP8 linears hold their FP8 weights and block scales as parameters
  and buffers, and a graph reads those; each replays the activations' quantization and the block-scaled
  GEMMs it captured. FP8 MoE experts keep master weights and an FP8 copy made from them: graphs read
  the copy, which :meth:`DecodeGraphs.refresh` quantizes again in place after a load. Their grouped
  GEMMs must read the per-expert offsets on the device: DeepGEMM's do, and so does the scaled_mm
  backend's Triton kernel (:mod:`rlcli.ops.fp8.grouped_triton`); a backend that loops over the
  experts (the CPU emulation) reads them on the host, and its engine decodes eagerly.

An MoE model's graphs record every row's experts (R3) in every replay (the routed experts' GEMMs are
torch's grouped GEMM, which reads its offsets on the device); the engine keeps them where asked for.
MLA models' graphs attend in latent form through the same kernel (one K/V head: the latent and the
rotary key; the value a view of the latent). DSA models choose their tokens without the host
(:func:`rlcli.ops.mla.paged_select_topk`: the indexer's keys scored in place by block table, over the
table's full width, ``max_model_len``, and always ``index_topk`` entries) and read them by cache slot.
Prefill chunks, mixed steps and steps larger than the largest size run eagerly, as do engines the
graphs do not cover (:func:`unsupported`) and engines whose capture failed (logged, and named by
the engine's ``decode_mode``).
"""

import bisect
import time

import numpy as np
import torch

from rlcli.models.moe import MoE
from rlcli.ops import mla
from rlcli.ops.attention import ForwardContext, PagedAttention, PagedAttentionMetadata, RoutingContext
from rlcli.ops.fp8.convert import FP8GroupedExperts

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16
MAX_SIZE = 512
"""The largest batch graphed (as vLLM's default): larger decode steps have kernels long enough that
launching them one by one costs little beside them, and each size more is a capture at start."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (at most
    ``MAX_SIZE``), which is always one."""
    top = min(max_num_seqs, MAX_SIZE)
    sizes = {s for s in SMALL_SIZES if s < top} | set(range(SIZE_STEP, top, SIZE_STEP))
    return sorted(sizes | {top})


def unsupported(model: torch.nn.Module, *, paged_decode: bool, batch_invariant: bool, role: str) -> str | None:
    """Why an engine's decodes cannot be graphed, or None: they can."""
    args = model.args
    if role == "prefill":
        return "a prefill server decodes nothing"
    if batch_invariant:
        return "model.batch_invariant decodes through its own kernel"
    if not paged_decode:
        return "infer.engine.paged_decode is off (the gathering path plans on the host every step)"
    param = next(model.parameters())
    if args.is_moe and not _grouped_kernel(param.device, param.dtype):
        return "MoE experts without torch's grouped GEMM (on CUDA: bf16) run one by one from host-side counts"
    if args.is_dsa and not mla.dsa_decodes_in_place(args, param):
        return "DSA's decodes need its Triton kernels (the indexer's scores by block table, sparse attention)"
    host = sorted({m.backend.name for m in model.modules()
                   if isinstance(m, FP8GroupedExperts) and not m.backend.grouped_on_device})
    if host:
        return (f"FP8 MoE experts on the {host[0]} GEMM backend loop over the experts from host-side counts "
                "(DeepGEMM's grouped GEMM and the scaled_mm backend's Triton one read them on the device)")
    try:
        from rlcli.ops import paged_decode
    except (ImportError, OSError):
        return "the paged decode kernel needs Triton"
    hq, hkv, d, dv = decode_heads(args)
    if not paged_decode.fits(hq // hkv, d, dv, param.dtype):
        return f"the paged decode kernel's tiles for {d}-wide keys do not fit in {param.dtype}"
    return None


def decode_heads(args) -> tuple[int, int, int, int]:
    """The decode kernel's (query heads, K/V heads, key width, value width) for a model: MLA attends
    in latent form, its one K/V head the latent and rotary key, its value the latent."""
    if args.kv_lora_rank:
        return args.num_attention_heads, 1, args.kv_lora_rank + args.qk_rope_head_dim, args.kv_lora_rank
    return args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.head_dim


def _grouped_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    from rlcli.ops.grouped_gemm import _kernel_available

    return _kernel_available(device, dtype)


class DecodeGraphs:
    """The graphs of one engine's decode steps, and the static buffers they read; see the module doc.
    ``kv_caches`` hold one block past the block manager's, ``scratch_block``, for the padding rows."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, ...]], *, block_size: int,
                 max_model_len: int, max_num_seqs: int, scratch_block: int):
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.scratch_block = block_size, scratch_block
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        dev = kv_caches[0][0].device
        self.device = dev
        B, W = self.max_size, -(-max_model_len // block_size)  # the widest table
        # ids | positions | slots | context lengths, one row each
        self.inputs = torch.zeros(4, B, dtype=torch.int64, device=dev)
        self.tables = torch.full((B, W), scratch_block, dtype=torch.int64, device=dev)
        self.tables_stage = torch.empty(B * W, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        self.inputs_host = torch.zeros(4, B, dtype=torch.int64, pin_memory=pin)
        self.tables_host = torch.empty(B * W, dtype=torch.int64, pin_memory=pin)
        self.copied = torch.cuda.Event() if pin else None  # the staging buffers may be refilled
        # Elsewhere (tests under Triton's interpreter) run() calls the forward itself: the same
        # buffers, padding and span counts, no graph.
        self.eager = dev.type != "cuda"
        self._heads = decode_heads(model.args)
        # (size, span count) -> (graph, its hidden states, its routes or None)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.moe = [m for m in model.modules() if isinstance(m, MoE)]  # their routes recorded in every graph
        self.fp8_experts = [m for m in model.modules() if isinstance(m, FP8GroupedExperts)]
        self.fingerprint: tuple[int, ...] = ()
        self.capture_s = 0.0

    # ------------------------------------------------------------------ capture
    def split_counts(self, size: int) -> list[int]:
        """The span counts graphed at ``size``: powers of two up to what ``max_model_len`` would use."""
        top = self._splits(size, self.max_model_len)
        return [1 << i for i in range(top.bit_length())]

    def _splits(self, size: int, longest: int) -> int:
        from rlcli.ops import paged_decode

        hq, hkv, d, dv = self._heads
        return paged_decode.splits_for(size, hq, hkv, d, dv, self.kv_caches[0][0].dtype, longest, self.device)

    def _weights(self) -> tuple[int, ...]:
        """Where the tensors a weight load writes live: parameters and persistent buffers. Not the
        other buffers: an MoE's ``num_tokens_per_expert`` (load-balance counts) is a new tensor after
        every eager forward, and counting it recaptured every graph at every weight load."""
        return tuple(t.data_ptr() for t in self.model.state_dict(keep_vars=True).values())

    def _forward(self, size: int, splits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode forward over the static buffers' first ``size`` rows: the final hidden states
        ``[size, hidden]``, and for an MoE model the experts each row was routed to ``[size, moe
        layers, top_k]`` (R3; recorded in every step, asked for or not: it is a copy of the top-k)."""
        ids, pos, slots, lens = self.inputs[:, :size]
        meta = PagedAttentionMetadata(slot_mapping=slots, query_start=list(range(size + 1)), context_lens=[1] * size,
                                      block_tables=self.tables[:size], block_size=self.block_size,
                                      num_decode=size, decode_splits=splits)
        meta._decode_lens = (lens.to(torch.int32), 0)
        routing = RoutingContext(record=True) if self.moe else None
        ctx = ForwardContext(attn=PagedAttention(self.kv_caches, meta, batch_invariant=False, paged_decode=True),
                             routing=routing)
        hidden = self.model.hidden_states(ids[None], pos[None], ctx)[0]
        return hidden, routing.stacked() if routing is not None else None

    @torch.no_grad()
    def capture(self) -> None:
        """(Re)capture every graph, largest first so the smaller ones reuse its memory pool. Each is
        run once before its capture (Triton compiles, the allocator settles). Every row is padding
        meanwhile: the KV written goes to the scratch block."""
        t0 = time.perf_counter()
        self.graphs.clear()
        self._pad(0, self.max_size, width=1)
        self.inputs.copy_(self.inputs_host)
        self.tables[:, :1].fill_(self.scratch_block)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        counts = [m.num_tokens_per_expert for m in self.moe]  # load counts: the trainer's metric, not the graphs'
        for size in reversed(self.sizes):
            for splits in self.split_counts(size):
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._forward(size, splits)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    hidden, routes = self._forward(size, splits)
                self.graphs[size, splits] = (graph, hidden, routes)
        torch.cuda.synchronize(self.device)
        for m, c in zip(self.moe, counts):
            m.num_tokens_per_expert = c
        self.fingerprint = self._weights()
        self.capture_s = time.perf_counter() - t0

    def refresh(self) -> bool:
        """After a weight load: capture again if a parameter's storage moved since the capture; whether
        it did. FP8 experts' blocks, quantized from their weights at capture, are quantized again in
        place first. Without a capture (:attr:`eager`) there is nothing to redo."""
        for m in self.fp8_experts:
            m.refresh_weights()
        if self.eager or self._weights() == self.fingerprint:
            return False
        self.capture()
        return True

    # ------------------------------------------------------------------ replay
    def _pad(self, first: int, size: int, width: int) -> None:
        """Rows ``first:size`` of the staging buffers as padding (see the module doc)."""
        h = self.inputs_host.numpy()
        h[0:2, first:size] = 0
        h[2, first:size] = self.scratch_block * self.block_size
        h[3, first:size] = 1
        self.tables_host.numpy()[first * width:size * width] = self.scratch_block

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_size

    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, context_lens: list[int],
            tables: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the graph for a step of ``S = len(ids)`` decodes (``tables``: their block tables
        ``[S, width]``, the longest context's blocks wide); their logits ``[S, V]`` and, for an MoE
        model, their routes ``[S, moe layers, top_k]`` (a view valid until the next replay)."""
        S, width = tables.shape
        size = self.sizes[bisect.bisect_left(self.sizes, S)]
        longest = max(context_lens)
        splits = 1 << (self._splits(size, longest).bit_length() - 1)  # the largest power of two not above
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies have left the staging buffers
        h = self.inputs_host.numpy()
        h[0, :S], h[1, :S], h[2, :S], h[3, :S] = ids, positions, slots, context_lens
        self.tables_host.numpy()[:S * width] = tables.ravel()
        self._pad(S, size, width)
        self.inputs.copy_(self.inputs_host, non_blocking=True)
        stage = self.tables_stage[:size * width]
        stage.copy_(self.tables_host[:size * width], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.tables[:size, :width].copy_(stage.view(size, width))
        if self.eager:
            hidden, routes = self._forward(size, splits)
        else:
            graph, hidden, routes = self.graphs[size, splits]
            graph.replay()
        return self.model.lm_head(hidden[:S]), routes[:S] if routes is not None else None
