"""rl-infer's OpenAI-compatible HTTP API: starlette on uvicorn, in a thread of its own.

The engine belongs to the serving loop's thread (``rlcli.infer.server``); this thread
never touches it. A handler validates and tokenizes the request, then hands the serving
loop a command through a ``queue.SimpleQueue`` and wakes it with a byte on an inproc
ZeroMQ PUSH socket that the loop polls next to its request socket. The loop adds the
request with ``stream=True`` and pushes its :class:`~rlcli.infer.base.Delta` s, its
final response, or the engine's ``ValueError``, into the handler's sink, which crosses
back into this thread's event loop with ``call_soon_threadsafe``. A handler that ends
early (every choice hit a stop string, or the client went away mid-stream) sends an
abort. Errors a client can cause are 4xx JSON bodies ``{"error": {"message", "type",
"code", "param"}}``; the server keeps serving.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream over
server-sent events with ``"stream": true``), ``POST /inference/v1/generate`` (vLLM's
token-in/token-out route: token ids in, sampled token ids, logprobs and policy versions
out; what verifiers' training client calls), ``GET /v1/models``, ``GET /health``.
"""

import asyncio
import json
import queue
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import AsyncIterator

import uvicorn
import zmq
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rlcli.config import RecipeConfig
from rlcli.errors import ConfigError
from rlcli.infer.base import Delta
from rlcli.infer.openai import (
    ApiError, ChatRequest, Choice, CompletionRequest, Formatter, TokenGenerateRequest, chat_prompt,
    check_token_sampling, check_unsupported, decode_request, sampling_params, token_generate_response,
)
from rlcli.logging import setup_logging
from rlcli.models.tokenizer import load_tokenizer
from rlcli.protocol import GenerateRequest, GenerateResponse
from rlcli.transport.zmq import context

log = setup_logging("rl-infer")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot serve HTTP on {host}:{port} ({e.strerror}); pick another --http-port "
                          "(0 is any free port) or infer.http_host") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


class Generation:
    """One HTTP request's life in the engine, seen from the event loop."""

    def __init__(self, door: "HttpFrontDoor", prompt_ids: list[int], sampling, salt: str):
        self.door, self.request_id = door, f"http-{uuid.uuid4().hex[:16]}"
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        loop = asyncio.get_running_loop()

        def sink(item) -> None:  # called on the serving thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, item)
            except RuntimeError:
                pass  # the event loop is closed: the server is stopping

        door.submit(("add", GenerateRequest(request_id=self.request_id, prompt_ids=prompt_ids, sampling=sampling,
                                            cache_salt=salt), sink))

    async def next(self) -> Delta | GenerateResponse:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            if isinstance(item, ValueError):
                raise ApiError(400, str(item))
            raise ApiError(503, str(item), type_="server_error")
        self.done = isinstance(item, GenerateResponse)
        return item

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.door.submit(("abort", self.request_id))


class HttpFrontDoor:
    def __init__(self, cfg: RecipeConfig, weights: str | Path):
        icfg = cfg.infer
        self.tokenizer = load_tokenizer(weights)
        self.model_name = Path(cfg.model.path).name or cfg.name
        self.max_model_len = cfg.model.max_seq_len
        self.max_body_bytes = icfg.http_max_body_bytes
        self.started = int(time.time())
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        address = f"inproc://rl-infer-http-{uuid.uuid4().hex}"
        self.wake_socket = context().socket(zmq.PULL)  # polled and drained by the serving thread only
        self.wake_socket.setsockopt(zmq.LINGER, 0)
        self.wake_socket.bind(address)
        self._waker = context().socket(zmq.PUSH)  # used by this front door's event-loop thread only
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.connect(address)
        sock = _listen(icfg.http_host, icfg.http_port)
        port = sock.getsockname()[1]
        host = socket.gethostbyname(socket.gethostname()) if icfg.http_host in ("0.0.0.0", "::") else icfg.http_host
        self.endpoint = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/inference/v1/generate", self.token_generate, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error})
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="rl-infer-http",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the serving thread's side
    def take_commands(self) -> list[tuple]:
        """Every command handed over since the last call (serving thread)."""
        while True:
            try:
                self.wake_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        out = []
        while True:
            try:
                out.append(self.commands.get_nowait())
            except queue.Empty:
                return out

    def submit(self, command: tuple) -> None:
        self.commands.put(command)
        try:
            self._waker.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # wake-ups are already pending: the loop will drain the queue

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._waker.close(linger=0)
        self.wake_socket.close(linger=0)

    # ------------------------------------------------------------------ handlers (event-loop thread)
    async def _body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise ApiError(413, f"request body of {length} bytes is over the limit of {self.max_body_bytes} "
                           "(infer.http_max_body_bytes)", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise ApiError(413, f"request body is over the limit of {self.max_body_bytes} bytes "
                               "(infer.http_max_body_bytes)", code="request_too_large")
        return bytes(body)

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ApiError(404, f"model {model!r} is not served here; GET /v1/models lists {self.model_name!r}",
                           code="model_not_found", param="model")

    async def completions(self, request: Request) -> Response:
        req = decode_request(await self._body(request), CompletionRequest)
        self._check_model(req.model)
        check_unsupported(req)
        prompt_ids = self.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return await self._generate(False, req, prompt_ids, req.max_tokens)

    async def chat_completions(self, request: Request) -> Response:
        req = decode_request(await self._body(request), ChatRequest)
        self._check_model(req.model)
        check_unsupported(req)
        prompt_ids = chat_prompt(req, self.tokenizer)
        return await self._generate(True, req, prompt_ids, req.max_completion_tokens or req.max_tokens)

    async def token_generate(self, request: Request) -> Response:
        req = decode_request(await self._body(request), TokenGenerateRequest)
        self._check_model(req.model)
        if req.stream:
            raise ApiError(400, "stream is not supported on /inference/v1/generate", param="stream")
        check_token_sampling(req.sampling_params)
        prompt_ids = list(req.token_ids)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ApiError(400, f"token_ids must be in [0, {vocab})", param="token_ids")
        sp = req.sampling_params
        sampling, _ = sampling_params(sp, len(prompt_ids), self.max_model_len, sp.max_tokens, vocab)
        choices = [Choice(i, self.tokenizer, []) for i in range(sampling.n)]
        gen = Generation(self, prompt_ids, sampling, req.cache_salt)
        num_cached = None
        try:
            async for num_cached in _events(gen, choices):
                pass
        finally:
            gen.abort()
        return JSONResponse(token_generate_response(gen.request_id, prompt_ids, choices, num_cached))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.started, "owned_by": "rlcli",
            "max_model_len": self.max_model_len}]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _generate(self, chat: bool, req, prompt_ids: list[int], max_tokens: int | None) -> Response:
        sampling, stops = sampling_params(req, len(prompt_ids), self.max_model_len, max_tokens,
                                          self.tokenizer.vocab_size)
        fmt = Formatter(chat, req, self.model_name, prompt_ids, self.tokenizer)
        choices = [Choice(i, self.tokenizer, stops) for i in range(sampling.n)]
        gen = Generation(self, prompt_ids, sampling, req.cache_salt)
        events = _events(gen, choices)
        try:
            first = await anext(events)  # engine errors surface here, before any byte is sent
        except BaseException:
            gen.abort()
            raise
        if not req.stream:
            try:
                num_cached = first
                async for num_cached in events:
                    pass
            finally:
                gen.abort()
            return JSONResponse(fmt.response(choices, num_cached))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_sse(fmt, choices, gen, first, events, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _events(gen: Generation, choices: list[Choice]) -> AsyncIterator[int | None]:
    """Feed the engine's deltas to the choices; yields after each step's deltas (None) and
    finally the response's cached-token count, or None if every choice stopped early."""
    while True:
        item = await gen.next()
        if isinstance(item, GenerateResponse):
            yield item.num_cached_tokens
            return
        choices[item.index].feed(item)
        if all(c.finish_reason is not None for c in choices) and not all(c.engine_done for c in choices):
            gen.abort()  # stop strings ended every choice; the engine need not go on
            yield None
            return
        yield None


def _data(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(fmt: Formatter, choices: list[Choice], gen: Generation, first, events, include_usage: bool):
    sent_first = set()
    num_cached = first
    try:
        while True:
            for c in choices:
                chunk = fmt.chunk(c, c.index not in sent_first)
                if chunk is not None:
                    sent_first.add(c.index)
                    yield _data(chunk)
            try:
                num_cached = await anext(events)
            except StopAsyncIteration:
                break
            except ApiError as e:
                yield _data(e.body())
                break
        if include_usage:
            yield _data(fmt.usage_chunk(choices, num_cached))
        yield b"data: [DONE]\n\n"
    finally:
        gen.abort()  # the client went away mid-stream, or we are done (then this does nothing)


async def _api_error(request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "code": None, "param": None}},
                        status_code=exc.status_code)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("HTTP %s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return JSONResponse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "code": None,
                                   "param": None}}, status_code=500)
