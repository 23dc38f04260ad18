"""The ``Engine`` seam: what rl-infer's server needs from an inference backend.

The server (``rlcli.infer.server``) owns sockets (ZeroMQ, HTTP), the registry and request
routing; an engine owns a model, its tokenizer (for its EOS ids), its KV cache and its
scheduler. The server talks to an engine only through this Protocol and builds it only
through :func:`rlcli.infer.factory.make_engine`, so the native engine (pure torch, the
CPU/CI reference, CUDA too) and vLLM are interchangeable behind ``--engine``.

Construction: each backend has ``from_config(cfg: RecipeConfig, weights: Path, version:
int, instance: int) -> Self`` that loads the weights directory ``weights`` (policy
``version``) on ``cfg.infer.device`` in ``cfg.infer.dtype`` (empty: ``cfg.model.dtype``),
with ``cfg.model.max_seq_len`` as its context and a sampling seed derived from
``cfg.seed`` and ``instance``.

Contract:
- ``add_request(req, stream=False)`` validates and queues; bad input (empty prompt, a
  prompt of ``max_model_len`` tokens or more, token ids outside the vocabulary, n or
  max_tokens < 1, a request_id already running) raises ``ValueError`` (the server turns it
  into an ``ErrorReply`` or an HTTP 400) and leaves the engine unchanged. The EOS ids of
  the model's tokenizer stop a completion unless ``sampling.ignore_eos``.
- ``step()`` advances every running request by at most one forward pass and returns the
  requests that finished in it as full :class:`GenerateResponse` s (every token, logprob
  and version of each of the ``n`` completions). For requests added with ``stream=True``
  it also returns, before their response, one :class:`Delta` per completion that gained
  tokens in this step (the HTTP API streams these). Weights change only between two
  calls of ``step``.
- ``abort(request_id)`` forgets a request at once; nothing more is returned for it.
- ``load_weights(ref, version)`` swaps weights in place; running requests keep their KV
  and continue, every later token tagged ``version``. Prefix-cache blocks are keyed by the
  request's ``cache_salt`` *and* the weights version that computed them: KV computed by
  other weights is never reused, also for requests that arrive after the swap with an
  old salt, requests queued across it and re-prefills after preemption. A ``WeightsRef``
  kind the engine cannot receive raises ``ValueError``.
- ``stats()`` returns flat float counters for ``HealthResponse.stats``; it always holds
  ``num_running`` and ``num_waiting`` (sequences), ``num_generated_tokens`` and
  ``num_aborted`` (requests ``abort`` forgot).
"""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rlcli.protocol import GenerateRequest, GenerateResponse, WeightsRef


@dataclass
class Delta:
    """Tokens one completion of a streamed request gained in one ``step``."""

    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # policy version that sampled each token
    finish_reason: str | None = None  # "stop" or "length" on the completion's last delta


@runtime_checkable
class Engine(Protocol):
    version: int
    """Policy version of the weights the engine serves now."""
    weight_receivers: int
    """Members this engine puts in a collective weight update: one per process that holds weights (vLLM's
    tensor-parallel workers take ranks ``NcclWeights.rank`` onward)."""

    def add_request(self, req: GenerateRequest, stream: bool = False) -> None:
        """Queue a request; ``stream`` makes ``step`` also return its :class:`Delta` s."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop and forget a request; False if it is unknown (already finished or aborted)."""
        ...

    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        ...

    def step(self) -> list[GenerateResponse | Delta]:
        """One forward pass: deltas of streamed requests, then the requests that finished."""
        ...

    def load_weights(self, ref: WeightsRef, version: int) -> None:
        """Swap weights between two steps; later tokens are tagged ``version``."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block not held by a running sequence."""
        ...

    def stats(self) -> dict[str, float]:
        """Flat counters, at least num_running, num_waiting, num_generated_tokens and num_aborted."""
        ...

    def close(self) -> None:
        """Release the model and the KV cache (and any worker processes)."""
        ...
