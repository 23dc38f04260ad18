"""The ``Engine`` seam: what rl-infer's server needs from an inference backend.

The server (``rlcli.infer.server``) owns sockets, the registry and request routing; an
engine owns a model, its KV cache and its scheduler. The server talks to an engine only
through this Protocol, so the native engine (pure torch, the CPU/CI reference) and vLLM
(the GPU engine) are interchangeable behind ``--engine``.

Contract:
- ``add_request`` validates and queues; bad input raises ``ValueError`` (the server turns
  it into an ``ErrorReply``) and leaves the engine unchanged.
- ``step`` advances every running request by at most one forward pass and returns the
  requests that finished in it. Weights change only between two calls of ``step``.
- ``load_weights(ref, version)`` swaps weights in place; running requests keep their KV
  and continue, every later token tagged ``version``. Prefix-cache blocks computed under
  other weights are never reused afterwards.
- ``stats`` returns flat float counters for ``HealthResponse.stats``; it always holds
  ``num_running`` and ``num_waiting``.
"""

from typing import Protocol, runtime_checkable

from rlcli.protocol import GenerateRequest, GenerateResponse, WeightsRef


@runtime_checkable
class Engine(Protocol):
    version: int
    """Policy version of the weights the engine serves now."""

    def add_request(self, req: GenerateRequest) -> None: ...

    def abort(self, request_id: str) -> bool:
        """Stop and forget a request; False if it is unknown (already finished or aborted)."""
        ...

    def has_work(self) -> bool: ...

    def step(self) -> list[GenerateResponse]: ...

    def load_weights(self, ref: WeightsRef, version: int) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...
