"""The native inference engine: continuous batching over a block-paged KV cache.

Each :meth:`NativeEngine.step` schedules one forward pass over a flattened batch:
one token for every running sequence (decode) and a chunk of prompt for newly admitted
ones (chunked prefill, up to ``max_num_batched_tokens``). Prefill and decode are the
same operation, "compute tokens[num_computed:] and sample after the last one", so a
preempted sequence simply re-prefills its tokens when readmitted. The engine schedules,
samples and keeps the books (the scheduling in :mod:`rlcli.infer.scheduling`, the shared KV store's
side in :mod:`rlcli.infer.shared_kv`); the model's side of a step (the KV cache, the inputs' copy to the
device, the forward, CUDA graphs of decode steps) is :class:`~rlcli.infer.model_runner.ModelRunner`'s.

A request for ``n`` completions prefills its prompt once, samples ``n`` first tokens
from the last prompt position and forks: the children share the prompt's full blocks
and each gets a copy of the partial last block.

Weights change only between steps (:meth:`load_weights`); running sequences keep their
KV and continue under the new weights, and every token records the policy version that
sampled it. Prefix-cache blocks are keyed by the request's cache salt and the weights
version that computed them, and looked up with the version served now, so a request
never reads KV of other weights: not in the window between a swap and the
orchestrator's ``PolicyUpdated`` (new requests still carry the old salt), not when it
waited across a swap, and not when it re-prefills after preemption.

With a :class:`~rlcli.infer.kv_connector.KVConnector` (``--kv-cache``) the prefix cache
extends to a shared store: a prompt whose next blocks are not cached here fetches the
longest run the store holds (same keys, so the same salt-and-version rule). The fetch
runs in the background: the prompt stays waiting, holding no blocks, while the engine
steps every other request (a later prompt whose next block is in that fetch waits for it
rather than fetching it again); once the fetch is done, the scheduler copies the blocks
into fresh ones just before the prompt's admission, once they fit beside what runs (several
fetches taken at once would evict one another's blocks in a full cache; a fetch nobody waits
for any more, or done ``FETCH_HOLD_S`` ago, is taken at a step's start; one that started under
other weights is dropped).
A fetch small enough to be done within ``FETCH_GRACE_S`` is waited for, so its prompt
joins the step being scheduled rather than the next one. A mixture-of-experts engine with a
store records every step's routes and keeps them with every full block, in the store too, so
R3 requests fetch like any other (and take only blocks whose routes are known).
Full blocks are published after each prefill chunk and when a completion finishes (only
enqueued: a background thread moves them; in pieces, and what the publish queue has no room
for is offered again at the next chunk). ``role`` splits the work: a prefill server
answers each request with one token once its prompt's blocks are stored; a decode server
is a mixed one that other servers' prefills feed.

With ``batch_invariant`` (``model.batch_invariant``) a token's numbers do not depend on the
rest of the step: linears run on row counts that round every row alike, attention in the fixed order the trainer's
``invariant`` backend uses, and reported logprobs use the trainer's formula, so the trainer
recomputes the same bits (:mod:`rlcli.ops.batch_invariant`; GQA and MLA models, DSA included, on the
CPU and on CUDA, where both sides run the Triton kernels of :mod:`rlcli.ops.invariant_kernels`).
"""


import time
from collections import deque
from pathlib import Path

import msgspec
import torch

from rlcli.config import RecipeConfig
from rlcli.errors import ConfigError
from rlcli.infer.base import Delta
from rlcli.infer.block_manager import BlockManager, chain_hash
from rlcli.infer.cuda_graphs import DecodeGraphs
from rlcli.infer.kv_connector import KVConnector, make_kv_connector
from rlcli.infer.model_runner import ModelRunner
from rlcli.infer.scheduling import SchedulingMixin
from rlcli.infer.shared_kv import Fetch, SharedKVMixin
from rlcli.infer.receiver import WeightReceiver
from rlcli.infer.sequence import Request, RouteLog, Sequence
from rlcli.models import DTYPES, CausalLM, load_model
from rlcli.models.tokenizer import load_tokenizer
from rlcli.ops.logprobs import token_logprobs_of
from rlcli.ops.sampling import sample
from rlcli.protocol import (
    Completion, GenerateRequest, GenerateResponse, WeightsRef, WireTensor,
)
from rlcli.transport.atomic import checksums_of


def _per_row(values: list[float], device: torch.device) -> torch.Tensor:
    """A float32 tensor of ``values`` on ``device``: filled there when they are all equal (no copy)."""
    first = values[0]
    if all(v == first for v in values):
        return torch.full((len(values),), first, dtype=torch.float32, device=device)
    return torch.tensor(values, dtype=torch.float32, device=device)


def resolve_device(name: str) -> torch.device:
    """``infer.device`` as a torch device, refusing a CUDA device torch cannot see."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"infer.device is {name} but torch sees no CUDA device; pass --device cpu")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"infer.device is {name} but torch sees {torch.cuda.device_count()} CUDA devices; "
                              "pick another --device")
    return device


class NativeEngine(SchedulingMixin, SharedKVMixin):
    """The native implementation of :class:`rlcli.infer.base.Engine`."""

    weight_receivers = 1  # one process, one device

    def __init__(self, model: CausalLM, *, eos_token_ids: list[int], max_model_len: int, block_size: int = 16,
                 kv_cache_memory_mb: int = 256, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, version: int = 0, seed: int = 0, role: str = "mixed",
                 batch_invariant: bool = False, paged_decode: bool = True, cuda_graphs: bool = True,
                 fused_kernels: bool = True):
        self.runner = ModelRunner(model, max_model_len=max_model_len, block_size=block_size,
                                  kv_cache_memory_mb=kv_cache_memory_mb, max_num_seqs=max_num_seqs, role=role,
                                  batch_invariant=batch_invariant, paged_decode=paged_decode, cuda_graphs=cuda_graphs,
                                  fused_kernels=fused_kernels)
        self.model = self.runner.model
        self.batch_invariant, self.paged_decode = batch_invariant, paged_decode
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.kv_caches = self.runner.kv_caches
        num_blocks = self.runner.num_blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, block_size)
        self.version = version
        self.receiver = WeightReceiver(self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.role = role
        self.kv: KVConnector | None = None  # attach_kv_connector
        self.is_moe = model.args.is_moe
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.fetches: list[Fetch] = []  # shared-store fetches in flight
        self.new_fetches: list[Fetch] = []  # of which started by this step's scheduling
        self.fetching: dict[bytes, Fetch] = {}  # each of their keys -> its fetch
        # Finished sequences' block runs the publish queue had no room for: (hashes, blocks).
        self.publish_backlog: list[tuple[list[bytes], list[int]]] = []
        self.counters = {"num_generated_tokens": 0, "num_prompt_tokens": 0, "num_cached_tokens": 0,
                         "num_steps": 0, "num_preemptions": 0, "num_requests": 0, "num_aborted": 0,
                         "num_kv_fetched_tokens": 0, "kv_fetch_idle_s": 0.0, "kv_publish_engine_s": 0.0,
                         "kv_publish_deferred": 0, "step_s": 0.0, "kv_fetches_taken": 0, "kv_fetch_ready_s": 0.0, "kv_fetch_taken_after_s": 0.0}
        if self.device.type == "cuda":
            self.warm_up()
            self.runner.capture_graphs()

    @classmethod
    def from_config(cls, cfg: RecipeConfig, weights: Path, version: int, instance: int = 0) -> "NativeEngine":
        """Load the model and tokenizer of ``weights`` on ``infer.device`` (see ``rlcli.infer.base``)."""
        icfg, ecfg = cfg.infer, cfg.infer.engine
        if ecfg.num_threads and ecfg.threads == "fixed":  # adaptive: the server's CoreShare sets them
            torch.set_num_threads(ecfg.num_threads)
        device = resolve_device(icfg.device)
        # infer.fp8: FP8 weights + scales (as published, or quantized on load as the trainer's forward does)
        model = load_model(weights, device=device, dtype=DTYPES[icfg.dtype or cfg.model.dtype], seed=cfg.seed,
                           fp8=icfg.fp8, fp8_storage=True, checksums=checksums_of(weights))
        if icfg.fp8.enabled and icfg.fp8.jit_warmup:  # DeepGEMM's kernels for every batch size (rlcli.ops.fp8.warmup)
            from rlcli.ops.fp8.warmup import warm_up_model

            warm_up_model(model, max_tokens=icfg.max_num_batched_tokens + icfg.max_num_seqs,
                          top_k=model.args.num_experts_per_tok, backward=False, device=device, ue8m0=icfg.fp8.ue8m0,
                          tokens=icfg.fp8.jit_warmup_tokens or None)
        eos = sorted(set(load_tokenizer(weights).eos_token_ids) | set(model.args.eos_token_id))
        engine = cls(model, eos_token_ids=eos, max_model_len=cfg.model.max_seq_len, block_size=ecfg.block_size,
                     kv_cache_memory_mb=ecfg.kv_cache_memory_mb, max_num_seqs=icfg.max_num_seqs,
                     max_num_batched_tokens=icfg.max_num_batched_tokens,
                     enable_prefix_caching=icfg.enable_prefix_caching, version=version,
                     seed=cfg.seed * 1000 + instance, role=icfg.role, batch_invariant=cfg.model.batch_invariant,
                     paged_decode=ecfg.paged_decode, cuda_graphs=ecfg.cuda_graphs, fused_kernels=ecfg.fused_kernels)
        engine.kv = make_kv_connector(icfg.kv_cache, engine.block_meta(), engine.device)
        return engine

    def warm_up(self) -> None:
        """Compile the decode path's kernels now (:meth:`ModelRunner.warm_up`); only while every
        KV block is free (before any request). Run at construction on CUDA."""
        if len(self.blocks.free) < self.blocks.num_blocks:
            raise RuntimeError("NativeEngine.warm_up runs only while every KV block is free (before any request)")
        self.runner.warm_up()

    # ------------------------------------------------------------------ public API
    def add_request(self, req: GenerateRequest, stream: bool = False) -> None:
        sp = req.sampling
        if not req.prompt_ids:
            raise ValueError("prompt_ids is empty")
        if len(req.prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(req.prompt_ids)} tokens does not fit max_model_len {self.max_model_len}")
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already running")
        vocab = self.model.args.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if sp.n < 1 or sp.max_tokens < 1:
            raise ValueError("sampling.n and sampling.max_tokens must be >= 1")
        if sp.prompt_logprobs >= len(req.prompt_ids):
            raise ValueError(f"sampling.prompt_logprobs {sp.prompt_logprobs} must be below the prompt's "
                             f"{len(req.prompt_ids)} tokens")
        if sp.prompt_logprobs > 0 and self.role == "prefill":
            raise ValueError("a prefill server does not score prompts (sampling.prompt_logprobs): ask a mixed server")
        if sp.n > self.max_num_seqs and self.role != "prefill":
            raise ValueError(f"sampling.n {sp.n} exceeds infer.max_num_seqs {self.max_num_seqs}, the most sequences "
                             "decoded together: raise infer.max_num_seqs or lower n")
        # One completion at its longest, plus the n - 1 copies of the prompt's partial block made
        # at the fork, must fit the whole cache, or the scheduler could never run it.
        longest = min(len(req.prompt_ids) + sp.max_tokens, self.max_model_len)
        need = -(-longest // self.block_size) + sp.n - 1
        if need > self.blocks.num_blocks:
            raise ValueError(f"this request needs {need} KV blocks and the cache has {self.blocks.num_blocks}; "
                             "lower max_tokens or n, or raise infer.engine.kv_cache_memory_mb")
        if self.role == "prefill":  # compute the prompt's KV and one token; a decode server generates
            sp = msgspec.structs.replace(sp, n=1, max_tokens=1)
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
        gen = torch.Generator(device=self.device).manual_seed(sp.seed) if sp.seed is not None else None
        r = Request(req.request_id, list(req.prompt_ids), sp, req.cache_salt, frozenset(stop), gen, [None] * sp.n,
                    stream=stream, prompt_logprobs=[] if sp.prompt_logprobs > 0 else None)
        self.requests[r.request_id] = r
        self.waiting.append(Sequence(r, -1, list(r.prompt_ids)))
        self.counters["num_requests"] += 1

    def abort(self, request_id: str) -> bool:
        r = self.requests.pop(request_id, None)
        if r is None:
            return False
        self.counters["num_aborted"] += 1
        for queue in (self.running, self.waiting):
            for seq in [s for s in queue if s.req is r]:
                self.blocks.release(seq.blocks)
                queue.remove(seq)
        return True  # a fetch it waited for is still taken into the local prefix cache

    def has_work(self) -> bool:
        # Torn weights (a collective load broke midway): hold every request until a full load.
        return bool(self.waiting or self.running) and not self.receiver.torn

    @torch.no_grad()
    def load_weights(self, ref: WeightsRef, version: int) -> None:
        """Swap in new weights between two steps; running sequences keep going. A failed
        load leaves the previous version serving (see ``rlcli.infer.receiver``)."""
        self.receiver.load(self.model, ref, version)
        self.version = version
        self.runner.refresh_graphs()  # a load that moved a parameter's storage invalidated them
        self.publish_backlog.clear()  # KV of the old weights: published now it would carry the new layout
        if self.kv is not None:
            self.kv.meta = self.block_meta()

    @property
    def decode_mode(self) -> str:
        """How decode steps run, for the server's log (:attr:`ModelRunner.decode_mode`)."""
        return self.runner.decode_mode

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.runner.graphs

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        bm = self.blocks
        return {**{k: float(v) for k, v in self.counters.items()},
                "num_running": float(len(self.running)), "num_waiting": float(len(self.waiting)),
                "prefix_cache_hit_rate": bm.num_hits / bm.num_queries if bm.num_queries else 0.0,
                "kv_blocks_free": float(bm.num_available), "kv_blocks_total": float(bm.num_blocks),
                "num_graph_steps": float(self.runner.graph_steps),
                **(self.kv.stats() if self.kv is not None else {})}

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()
            self.kv = None
        self.receiver.close()
        self.runner.close()
        for seq in [*self.running, *self.waiting]:
            self.blocks.release(seq.blocks)
        self.running, self.requests, self.kv_caches = [], {}, []
        self.waiting.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def step(self) -> list[GenerateResponse | Delta]:
        """Run one forward pass; return streamed deltas and the requests that finished in it."""
        if self.receiver.torn:
            return []
        if self.publish_backlog:
            self.publish_pending()
        batch = self._schedule()
        if not batch:
            self._idle_until_fetched()
            return []
        self.counters["num_steps"] += 1
        t0 = time.perf_counter()
        logits, routes = self._forward(batch)
        out = self._postprocess(batch, logits, routes)
        if self.role == "prefill" and self.kv is not None and any(isinstance(o, GenerateResponse) for o in out):
            self.kv.flush(self.kv.timeout_s)  # answer once the decode server can find the blocks
        self.counters["step_s"] += time.perf_counter() - t0  # forward + sampling, the host sync included
        return out

    # ------------------------------------------------------------------ forward
    def _forward(self, batch: list[tuple[Sequence, int]]):
        record = self.carries_routes or (self.is_moe and any(seq.req.sampling.return_routing for seq, _ in batch))
        scored = [i for i, (seq, _) in enumerate(batch) if seq.index < 0 and seq.req.prompt_logprobs is not None]
        if not scored:
            return self.runner.forward(batch, record)
        logits, routes, hidden = self.runner.forward(batch, record, keep=scored)
        for i, h in zip(scored, hidden):
            self._score_prompt(batch[i][0], batch[i][1], h)
        return logits, routes

    def _score_prompt(self, seq: Sequence, n: int, hidden_ND: torch.Tensor) -> None:
        """Append the logprobs of the prompt tokens this prefill chunk predicts (from
        ``sampling.prompt_logprobs`` on): position p's logits score token p + 1."""
        r, first = seq.req, seq.num_computed  # the chunk is tokens[first:first + n]
        start, end = r.sampling.prompt_logprobs, len(r.prompt_ids)
        # Positions whose next token is scored, past those already scored (a preempted prompt is recomputed).
        lo, hi = max(first, start - 1 + len(r.prompt_logprobs)), min(first + n, end - 1)
        if lo >= hi:
            return
        temperature = r.sampling.temperature if r.sampling.temperature > 0 else 1.0
        targets = torch.tensor(r.prompt_ids[lo + 1:hi + 1], device=hidden_ND.device)
        for a in range(lo, hi, 1024):  # the vocabulary's logits for at most 1024 positions at a time
            b = min(a + 1024, hi)
            logits = self.model.lm_head(hidden_ND[a - first:b - first]).float() / temperature
            lps = torch.log_softmax(logits, dim=-1).gather(-1, targets[a - lo:b - lo, None])[:, 0]
            r.prompt_logprobs.extend(lps.tolist())

    # ------------------------------------------------------------------ sampling and bookkeeping
    def _postprocess(self, batch, logits, routes) -> list[GenerateResponse | Delta]:
        rows, owners = [], []  # the batch row each sampled token comes from, and its sequence (a prompt's n times)
        offset, bs, version = 0, self.block_size, self.version
        if routes is not None:
            routes = routes.to(torch.int16).cpu().numpy()  # one copy to the host for the step, not one per sequence
        for i, (seq, n) in enumerate(batch):
            if routes is not None and (seq.req.sampling.return_routing or self.carries_routes):
                seq.routes.append(routes[offset:offset + n])
            offset += n
            seq.num_computed += n
            if len(seq.hashes) < seq.num_computed // bs:
                self._register_full_blocks(seq)
            else:  # no block filled (most decodes): the weights that computed the partial one
                seq.partial_versions.add(version)
            if seq.num_computed < len(seq.tokens):
                self._publish(seq)  # a long prompt's blocks reach the store chunk by chunk
                continue  # a prefill chunk: nothing to sample yet
            if seq.index < 0:
                self._publish(seq)  # the prompt's blocks, before the fork shares them
                rows += [i] * seq.req.sampling.n
                owners += [seq] * seq.req.sampling.n
            else:
                rows.append(i)
                owners.append(seq)
        if not rows:
            return []
        dev = self.device
        params = [seq.req.sampling for seq in owners]
        temps, top_ps = [p.temperature for p in params], [p.top_p for p in params]
        row_gens = {k: seq.req.generator for k, seq in enumerate(owners) if seq.req.generator is not None}
        # A decode-only step samples every row once, in order, with the same settings throughout:
        # then nothing needs indexing or a copy to the device.
        row_logits = logits if rows == list(range(len(batch))) else logits[torch.tensor(rows, device=dev)]
        greedy = sum(t <= 0 for t in temps)
        tokens, logprobs = sample(row_logits, _per_row(temps, dev), _per_row(top_ps, dev), self.generator, row_gens,
                                  any_top_p=any(p < 1 for p in top_ps),
                                  greedy_rows="none" if not greedy else "all" if greedy == len(temps) else None,
                                  kernel=self.runner.fused_off is None)
        if self.batch_invariant:
            logprobs = self._trainer_logprobs(row_logits, tokens, logprobs, temps, top_ps)
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        sampled: list[Sequence] = []  # completion sequences that got a token, in order
        finished: dict[int, Request] = {}  # requests with a completion finished this step
        j = 0
        while j < len(owners):
            seq = owners[j]
            for child in self._fork(seq) if seq.index < 0 else [seq]:
                if self._append(child, tokens[j], logprobs[j]):
                    finished[id(child.req)] = child.req
                sampled.append(child)
                j += 1
        self.counters["num_generated_tokens"] += len(sampled)
        out: list[GenerateResponse | Delta] = [self._delta(s) for s in sampled if s.req.stream]
        for r in finished.values():
            if r.done and self.requests.pop(r.request_id, None) is not None:
                out.append(GenerateResponse(request_id=r.request_id, completions=list(r.completions),
                                            num_prompt_tokens=len(r.prompt_ids),
                                            num_cached_tokens=r.num_cached_tokens,
                                            prompt_logprobs=r.prompt_logprobs or []))
        return out

    @staticmethod
    def _trainer_logprobs(logits_SV, tokens_S, logprobs_S, temps: list[float], top_ps: list[float]) -> torch.Tensor:
        """The sampled tokens' logprobs by the trainer's formula, per (temperature, top_p) group
        (greedy rows keep the sampler's)."""
        out = logprobs_S.clone()
        for temp, top_p in {(t, p) for t, p in zip(temps, top_ps) if t > 0}:
            idx = torch.tensor([i for i, (t, p) in enumerate(zip(temps, top_ps)) if (t, p) == (temp, top_p)],
                               device=logits_SV.device)
            out[idx] = token_logprobs_of(logits_SV[idx], tokens_S[idx], temp, top_p)
        return out

    def _delta(self, seq: Sequence) -> Delta:
        k, end = len(seq.req.prompt_ids) + seq.num_streamed, len(seq.tokens)
        first = seq.num_streamed
        seq.num_streamed = end - len(seq.req.prompt_ids)
        done = seq.req.completions[seq.index]
        return Delta(seq.req.request_id, seq.index, seq.tokens[k:end], seq.logprobs[first:],
                     seq.versions[first:], done.finish_reason if done is not None else None)

    def _register_full_blocks(self, seq: Sequence) -> None:
        """File each newly full block under the request's salt and the weights that computed
        it. A block computed across a swap names every version involved ("w3-w4"); lookups
        name exactly one, so its KV is never reused, nor is any block chained behind it."""
        bs = self.block_size
        seq.partial_versions.add(self.version)
        keep_routes = (seq.req.sampling.return_routing or self.carries_routes) and self.is_moe
        while len(seq.hashes) < seq.num_computed // bs:
            b = len(seq.hashes)
            weights = "-".join(f"w{v}" for v in sorted(seq.partial_versions))
            parent = seq.hashes[-1] if seq.hashes else None
            h = chain_hash(parent, f"{seq.req.salt}|{weights}", seq.tokens[b * bs:(b + 1) * bs])
            seq.hashes.append(h)
            # cached blocks keep their routes (R3)
            routes = torch.from_numpy(seq.routes.rows(b * bs, (b + 1) * bs)) if keep_routes else None
            self.blocks.register(seq.blocks[b], h, routes)
            seq.partial_versions = {self.version}
        if seq.num_computed % bs == 0:
            seq.partial_versions = set()

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Split a fully prefilled prompt into its n completion sequences."""
        r = parent.req
        self.running.remove(parent)
        self.counters["num_prompt_tokens"] += len(r.prompt_ids)
        self.counters["num_cached_tokens"] += r.num_cached_tokens
        children = []
        partial = parent.num_computed % self.block_size != 0
        # Each child after the first writes its own copy of a partial last block.
        copies = self._copy_block(parent.blocks[-1], r.sampling.n - 1) if partial else []
        shared = parent.routes.freeze()  # the prompt's routes, one array for every child
        for k in range(r.sampling.n):
            child = Sequence(r, k, list(parent.tokens), parent.num_computed, list(parent.blocks),
                             list(parent.hashes), routes=RouteLog(shared),
                             partial_versions=set(parent.partial_versions), num_published=parent.num_published)
            if k > 0:
                for b in child.blocks[:-1] if partial else child.blocks:
                    self.blocks.share(b)
                if partial:
                    child.blocks[-1] = copies[k - 1]
            children.append(child)
            self.running.append(child)
        return children

    def _copy_block(self, src: int, count: int) -> list[int]:
        """``count`` new blocks holding block ``src``'s KV: one copy per cache tensor, not per block."""
        if count <= 0:
            return []
        dsts = [self.blocks.allocate() for _ in range(count)]
        index = torch.tensor(dsts, device=self.device)
        source = torch.full((count,), src, device=self.device)
        for layer in self.kv_caches:
            for cache in layer:
                cache.index_copy_(0, index, cache.index_select(0, source))
        return dsts

    def _append(self, seq: Sequence, token: int, logprob: float) -> bool:
        """Add a sampled token; whether it finished the sequence."""
        tokens, r = seq.tokens, seq.req
        tokens.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(self.version)
        reason = None
        if token in r.stop_ids:
            reason = "stop"
        elif len(tokens) - len(r.prompt_ids) >= r.sampling.max_tokens or len(tokens) >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        self._finish(seq, reason)
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._publish(seq, finished=True)  # the completion's blocks serve the next turn of a conversation
        self.running.remove(seq)
        self.blocks.release(seq.blocks)
        seq.blocks = []
        r = seq.req
        routed = None
        if r.sampling.return_routing and self.is_moe:
            # Routes of every token that went through the model: prompt + generated - 1.
            routed = WireTensor.from_numpy(seq.routes.rows(0, len(seq.routes)))
        r.completions[seq.index] = Completion(
            token_ids=seq.tokens[len(r.prompt_ids):], logprobs=seq.logprobs, versions=seq.versions,
            finish_reason=reason, routed_experts=routed)
