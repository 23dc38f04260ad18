"""OpenAI-compatible request and response formats, apart from any web framework.

Requests are decoded by msgspec straight from the body bytes into the structs below:
unknown fields are ignored (clients send many), wrong types and missing fields become
an :class:`ApiError` naming the field. Every request becomes one engine request of ``n``
completions; :class:`Choice` turns each completion's token deltas into text, cutting it
at the first stop string (the tokens up to the one that completed the stop string are
kept in ``token_ids``; the engine request is aborted once every choice has stopped).

Beyond OpenAI's fields, requests may set ``return_token_ids`` (prompt and completion
token ids), ``return_tokens_as_token_ids`` (logprob entries name their token
``"token_id:N"``, so no text round trip is needed), ``return_policy_versions`` (the
policy version that sampled each token),
``stop_token_ids``, ``ignore_eos`` and ``cache_salt``, as vLLM's server does. Logprobs are
those of the sampled tokens only (``top_logprobs`` must be 0).

:class:`TokenGenerateRequest` is vLLM's token-in/token-out ``POST /inference/v1/generate``
(what verifiers' training client and prime-rl call): the prompt is token ids, the reply
holds each choice's sampled ``token_ids``, their logprobs as ``{"token": "token_id:N",
"logprob"}`` entries, and, as rlcli extras, ``policy_versions`` per token and the cached
prompt tokens in ``usage``.
"""

import math
import time
import uuid
from typing import Any, Optional, Union

import msgspec

from rlcli.infer.base import Delta
from rlcli.protocol import SamplingParams

MAX_N = 64
MAX_STOPS = 16


class ApiError(Exception):
    """An error the client caused (4xx) or a server state it should retry on (503)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "code": self.code, "param": self.param}}


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Request(msgspec.Struct, kw_only=True):
    model: str = ""
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    cache_salt: str = ""
    return_token_ids: bool = False
    return_policy_versions: bool = False
    return_tokens_as_token_ids: bool = False


class CompletionRequest(_Request, kw_only=True):
    prompt: Union[str, list[int]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: Union[str, list[ContentPart], None] = None


class ChatRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    add_generation_prompt: bool = True


class TokenSampling(msgspec.Struct, kw_only=True):
    """vLLM's ``sampling_params`` object, the fields rl-infer honours (others must keep their defaults)."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_tokens: Optional[int] = 16
    n: Optional[int] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None


class TokenGenerateRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    token_ids: list[int]
    sampling_params: TokenSampling = msgspec.field(default_factory=TokenSampling)
    cache_salt: str = ""
    stream: bool = False


def check_token_sampling(sp: TokenSampling) -> None:
    """Refuse sampling settings rl-infer's engines do not implement, rather than ignore them."""
    neutral = {"top_k": (None, 0, -1), "min_p": (None, 0.0), "repetition_penalty": (None, 1.0),
               "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0)}
    for name, values in neutral.items():
        if getattr(sp, name) not in values:
            raise ApiError(400, f"sampling_params.{name} is not supported by rl-infer", param=f"sampling_params.{name}")
    if sp.stop:
        raise ApiError(400, "sampling_params.stop (strings) is not supported on token generation; use stop_token_ids",
                       param="sampling_params.stop")
    if sp.logprobs not in (None, 0, 1):
        raise ApiError(400, "rl-infer returns the sampled token's logprob only; pass logprobs=1",
                       param="sampling_params.logprobs")


def token_generate_response(request_id: str, prompt_ids: list[int], choices: list["Choice"],
                            num_cached: int | None) -> dict[str, Any]:
    """The body of a token generation: vLLM's shape plus ``policy_versions`` per choice."""
    out = []
    for c in choices:
        out.append({"index": c.index, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                    "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                             for t, lp in zip(c.token_ids, c.logprobs)]},
                    "policy_versions": c.versions})
    completion = sum(len(c.token_ids) for c in choices)
    usage: dict[str, Any] = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                             "total_tokens": len(prompt_ids) + completion}
    if num_cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": num_cached}
    return {"request_id": request_id, "prompt_token_ids": prompt_ids, "choices": out, "usage": usage}


def decode_request(body: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"malformed JSON: {e}") from None


def chat_prompt(req: ChatRequest, tokenizer) -> list[int]:
    """The conversation rendered by the model's chat template, as token ids."""
    if req.tools:
        raise ApiError(400, "tools are not supported by rl-infer", param="tools")
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    messages = []
    for m in req.messages:
        if isinstance(m.content, list):
            if any(p.type != "text" for p in m.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            text = "".join(p.text for p in m.content)
        else:
            text = m.content or ""
        messages.append({"role": m.role, "content": text})
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
    except ValueError as e:  # no chat template, or the template raised
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None


def check_unsupported(req: _Request) -> None:
    """Refuse what rl-infer cannot honour rather than ignore it."""
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError(400, "echo is not supported by rl-infer", param="echo")
        if req.logprobs is not None and req.logprobs != 0:
            raise ApiError(400, "rl-infer returns the sampled token's logprob only; pass logprobs=0",
                           param="logprobs")
    elif req.top_logprobs:
        raise ApiError(400, "rl-infer returns the sampled token's logprob only; pass top_logprobs=0",
                       param="top_logprobs")


def sampling_params(req: _Request, num_prompt: int, max_model_len: int, max_tokens: int | None,
                    vocab_size: int) -> tuple[SamplingParams, list[str]]:
    """The engine's sampling parameters and the stop strings, or an ApiError naming the bad field."""
    if num_prompt == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if num_prompt >= max_model_len:
        raise ApiError(400, f"the prompt has {num_prompt} tokens; this model's context is {max_model_len} "
                       "tokens (prompt + completion)", code="context_length_exceeded", param="prompt")
    room = max_model_len - num_prompt
    if max_tokens is None:
        max_tokens = room
    if not 1 <= max_tokens <= room:
        raise ApiError(400, f"max_tokens must be in [1, {room}] for a prompt of {num_prompt} tokens "
                       f"(context {max_model_len}), got {max_tokens}", param="max_tokens")
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    n = 1 if req.n is None else req.n
    if not (math.isfinite(temperature) and 0 <= temperature <= 100):
        raise ApiError(400, f"temperature must be in [0, 100], got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise ApiError(400, f"seed must be in [0, 2**63), got {req.seed}", param="seed")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"stop takes at most {MAX_STOPS} non-empty strings", param="stop")
    if any(not 0 <= t < vocab_size for t in req.stop_token_ids):
        raise ApiError(400, f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, n=n,
                                  stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos, seed=req.seed)
    except ValueError as e:  # the wire format's own checks
        raise ApiError(400, str(e)) from None
    return sampling, stops


class Choice:
    """One completion's tokens and text as its deltas arrive."""

    def __init__(self, index: int, tokenizer, stops: list[str]):
        self.index, self.tokenizer, self.stops = index, tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # chars that may start a stop string
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.finish_sent = False
        self.engine_done = False  # the engine has finished this completion
        self.prefix_offset = self.read_offset = 0  # detokenization window (see _decode_new)

    def feed(self, delta: Delta) -> None:
        self.engine_done = delta.finish_reason is not None
        if self.finish_reason is not None:
            return  # stopped by a stop string; the engine may still be generating
        for token, logprob, version in zip(delta.token_ids, delta.logprobs, delta.versions):
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.versions.append(version)
            if self._extend(self._decode_new(final=False)):
                return
        if delta.finish_reason is not None and not self._extend(self._decode_new(final=True)):
            self.finish_reason = delta.finish_reason

    def _decode_new(self, final: bool) -> str:
        """The text the newest tokens add, decoding a short window rather than the whole
        completion (so the cost per token does not grow with its length); "" while they end
        inside a character, unless ``final``."""
        ids = self.token_ids
        known = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(ids[self.prefix_offset:])
        if len(text) > len(known) and (final or not text.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return text[len(known):]
        return ""

    def _extend(self, piece: str) -> bool:
        """Append ``piece``; True if that completed a stop string (the text then ends before it)."""
        if not piece:
            return False
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        hits = [p for p in (self.text.find(s, start) for s in self.stops) if p >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish_reason = "stop"
        return bool(hits)

    def take(self) -> tuple[str, list[int], list[float], list[int]]:
        """Text and tokens not yet sent; text that may still turn into a stop string is held back."""
        end = len(self.text)
        if self.finish_reason is None:
            end = max(self.num_sent_chars, end - self.hold)
        text = self.text[self.num_sent_chars:end]
        k = self.num_sent_tokens
        self.num_sent_chars, self.num_sent_tokens = end, len(self.token_ids)
        return text, self.token_ids[k:], self.logprobs[k:], self.versions[k:]


def token_strings(tokenizer, ids: list[int], as_ids: bool = False) -> list[str]:
    if as_ids:
        return [f"token_id:{t}" for t in ids]
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def completion_logprobs(tokenizer, ids: list[int], logprobs: list[float], offset: int = 0,
                        as_ids: bool = False) -> dict[str, Any]:
    tokens = token_strings(tokenizer, ids, as_ids)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokenizer, ids: list[int], logprobs: list[float], as_ids: bool = False) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(token_strings(tokenizer, ids, as_ids), logprobs)]}


class Formatter:
    """Builds the JSON bodies of one request's response or stream chunks."""

    def __init__(self, chat: bool, req: _Request, model: str, prompt_ids: list[int], tokenizer):
        self.chat, self.req, self.model, self.prompt_ids, self.tokenizer = chat, req, model, prompt_ids, tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.want_logprobs = (req.logprobs is not None) if not chat else bool(req.logprobs)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _extras(self, out: dict, ids: list[int], logprobs: list[float], versions: list[int], offset: int) -> dict:
        if self.want_logprobs:
            as_ids = self.req.return_tokens_as_token_ids
            out["logprobs"] = (chat_logprobs(self.tokenizer, ids, logprobs, as_ids) if self.chat
                               else completion_logprobs(self.tokenizer, ids, logprobs, offset, as_ids))
        else:
            out["logprobs"] = None
        if self.req.return_token_ids:
            out["token_ids"] = ids
        if self.req.return_policy_versions:
            out["policy_versions"] = versions
        return out

    def usage(self, choices: list[Choice], num_cached: int | None) -> dict[str, Any]:
        completion = sum(len(c.token_ids) for c in choices)
        usage = {"prompt_tokens": len(self.prompt_ids), "completion_tokens": completion,
                 "total_tokens": len(self.prompt_ids) + completion}
        if num_cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": num_cached}
        return usage

    def response(self, choices: list[Choice], num_cached: int | None) -> dict[str, Any]:
        body = self._head("chat.completion" if self.chat else "text_completion")
        out = []
        for c in choices:
            item: dict[str, Any] = {"index": c.index}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            self._extras(item, c.token_ids, c.logprobs, c.versions, 0)
            item["finish_reason"] = c.finish_reason
            out.append(item)
        body["choices"] = out
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        body["usage"] = self.usage(choices, num_cached)
        return body

    def chunk(self, c: Choice, first: bool) -> dict[str, Any] | None:
        """The next stream chunk of choice ``c``, or None if it has nothing new to say."""
        offset = c.num_sent_chars
        text, ids, logprobs, versions = c.take()
        says_tokens = bool(ids) and (self.want_logprobs or self.req.return_token_ids or self.req.return_policy_versions)
        if not (text or says_tokens or first) and (c.finish_reason is None or c.finish_sent):
            return None
        c.finish_sent = c.finish_reason is not None
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        item: dict[str, Any] = {"index": c.index}
        if self.chat:
            item["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            item["text"] = text
        self._extras(item, ids, logprobs, versions, offset)
        item["finish_reason"] = c.finish_reason
        body["choices"] = [item]
        if first and self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    def usage_chunk(self, choices: list[Choice], num_cached: int | None) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(choices, num_cached)
        return body
