"""verifiers (0.4.0) environments run by verifiers itself against rl-infer's HTTP API.

verifiers 0.4.0 (``verifiers.v1``) runs an episode as ``Env.run_episode(task, ctx)``: the
env's ``run`` plays its agents (one for a plain taskset; a user simulator, judges,
several segments of one conversation for multi-turn envs), each agent's harness program
calls an OpenAI-style endpoint that verifiers intercepts, and its *training client*
renders each turn to token ids and posts them to vLLM's ``/inference/v1/generate``, which
rl-infer serves (``rl-infer --http-port``). The trace it builds holds, per message, the
exact token ids the server saw and sampled, a mask that is True only on sampled tokens,
and their logprobs; when a turn's prompt does not extend the previous turn's tokens,
verifiers starts a new *branch*. The task's own rubric scores the trace (``trace.reward``).

This module turns those traces into rlcli training samples: every trainable branch is one
sample, its tokens up to the first sampled one the prompt, the rest the completion with
the branch's mask as the loss mask (environment, user and tool turns are context), the
branch's logprobs, and the policy version of every sampled token. verifiers keeps no
versions, so the client below is verifiers' training client with one addition: it reads
the ``policy_versions`` rl-infer returns beside each generation and files them by trace.
verifiers has no hook for a client of one's own, so :func:`install_client` wraps the
``resolve_client`` its interception server calls: configs of type
:class:`RlInferClientConfig` get this client, every other config verifiers' own. A
generation record whose tokens verifiers did not keep (a response a ``@stop`` refused) is
never matched; its branch's tokens then repeat the version before them, starting at the
group's dispatch version, a lower bound. Every turn of an episode carries the group's
cache salt, so later turns reuse the KV of earlier ones.
"""

import json
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI
from verifiers.v1.clients.base import MAX_RETRIES, build_async_httpx
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig, resolve_api_key

from rlcli.envs import vf_host  # noqa: F401  (registers the rlcli-host harness)


@dataclass
class Sample:
    """One trainable branch of one episode."""

    token_ids: list[int]
    """Prompt and completion, exactly as the server saw and sampled them."""
    loss_mask: list[bool]
    """True on tokens the model sampled."""
    logprobs: list[float]
    """Behaviour logprobs of the sampled tokens, 0.0 elsewhere."""
    versions: list[int]
    """Policy version of each sampled token; context tokens repeat the version before them."""
    reward: float
    """The trace's reward, from the task's own rubric."""
    num_turns: int = 1
    """Model calls on this branch."""
    turn_prompt_tokens: list[int] = field(default_factory=list)
    """Per model call: the prompt's tokens."""
    turn_cached_tokens: list[int] = field(default_factory=list)
    """Per model call: of those, tokens the server served from its prefix cache."""
    turn_completion_tokens: list[int] = field(default_factory=list)
    """Per model call: tokens it sampled."""
    finish_reason: str = ""
    """Why the last model call ended: 'stop' or 'length'."""
    error: str | None = None
    """Why verifiers failed the episode (None: it completed)."""


CALLS: dict[str, list[dict]] = {}
"""Trace id -> rl-infer's records of its generations, in call order (filled by every RlInferClient)."""


class RlInferClientConfig(TrainClientConfig):
    """verifiers' training client config, pointed at an rl-infer server."""


class RlInferClient(TrainClient):
    """verifiers' training client that also keeps rl-infer's per-token policy versions."""

    def __init__(self, config: TrainClientConfig) -> None:
        self.config = config
        self.pending: dict[str, dict] = {}  # request id -> rl-infer's generation record
        http = build_async_httpx(config)
        http.event_hooks["response"].append(self._on_response)
        self.client = AsyncOpenAI(base_url=config.base_url, api_key=resolve_api_key(config),
                                  max_retries=MAX_RETRIES, http_client=http)

    async def _on_response(self, response) -> None:
        if response.status_code != 200 or not response.request.url.path.endswith("/inference/v1/generate"):
            return
        await response.aread()
        data = json.loads(response.content)
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        self.pending[data["request_id"]] = {
            "completion_ids": choice["token_ids"], "versions": choice.get("policy_versions") or [],
            "finish_reason": choice.get("finish_reason") or "",
            "prompt_tokens": usage.get("prompt_tokens", len(data.get("prompt_token_ids") or [])),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):
        response = await super().get_response(dialect, body, sampling, session_id=session_id, turn=turn,
                                              headers=headers)
        record = self.pending.pop(response.id, None)
        if record is not None and session_id is not None:
            CALLS.setdefault(session_id, []).append(record)
        return response


def install_client() -> None:
    """Have verifiers' interception build :class:`RlInferClient` for :class:`RlInferClientConfig`."""
    import verifiers.v1.interception.server as server

    original = server.resolve_client
    if getattr(original, "rlcli", False):
        return

    def resolve_client(config):
        return RlInferClient(config) if isinstance(config, RlInferClientConfig) else original(config)

    resolve_client.rlcli = True
    server.resolve_client = resolve_client


def branch_samples(trace, calls: list[dict], version_floor: int) -> list[Sample]:
    """The trainable branches of ``trace`` as samples; ``calls`` are its generations in order."""
    samples = []
    if not trace.agent.trainable:
        return samples
    remaining = list(calls)
    for branch in trace.branches:
        if not branch.trainable:
            continue
        ids, mask, logprobs = branch.token_ids, branch.sampled_mask, branch.logprobs
        if not any(mask):
            continue
        versions: list[int] = []
        last = version_floor
        turns = []
        for node in branch.nodes:
            sampled = [t for t, m in zip(node.token_ids, node.mask) if m]
            record = None
            if sampled:
                record = next((c for c in remaining if c["completion_ids"] == sampled), None)
                if record is not None:
                    remaining.remove(record)
                    turns.append(record)
            node_versions = iter(record["versions"] if record is not None else [])
            for m in node.mask:
                if m:
                    last = next(node_versions, last)
                versions.append(last)
        samples.append(Sample(
            token_ids=ids, loss_mask=mask, logprobs=logprobs, versions=versions, reward=float(trace.reward or 0.0),
            num_turns=sum(1 for n in branch.nodes if any(n.mask)),
            turn_prompt_tokens=[c["prompt_tokens"] for c in turns],
            turn_cached_tokens=[c["cached_tokens"] for c in turns],
            turn_completion_tokens=[len(c["completion_ids"]) for c in turns],
            finish_reason=turns[-1]["finish_reason"] if turns else ""))
    return samples


def episode_samples(episode, version_floor: int) -> list[Sample]:
    """Every trainable branch of every trace of a verifiers episode."""
    out = []
    for trace in episode.traces:
        out += branch_samples(trace, CALLS.pop(trace.id, []), version_floor)
    if not episode.ok and episode.errors:
        error = f"{episode.errors[0].type}: {episode.errors[0].message}"
        for s in out:
            s.error = error
    return out


def dump(samples: list[Sample]) -> list[dict[str, Any]]:
    return [s.__dict__ for s in samples]
