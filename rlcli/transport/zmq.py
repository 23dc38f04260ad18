"""ZeroMQ sockets speaking :mod:`rlcli.protocol`.

Three patterns, each with its delivery contract in its docstring. All sockets close
with ``linger=0``: a process that exits never blocks on undelivered messages, because
every durable fact also lives in the run directory.
"""

import errno
import re
import socket
import time
import uuid
from typing import Iterable

import zmq

from rlcli.errors import ConfigError, PeerUnreachable
from rlcli.protocol import ErrorReply, Message, decode, decode_envelope, encode

DEFAULT_HWM = 10_000
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
"""Largest request a server reads (prompts of 131k tokens are ~1 MiB; KV blocks travel in batches)."""


def context() -> zmq.Context:
    return zmq.Context.instance()


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def advertised(host: str) -> str:
    """The address peers are told for a socket bound to ``host``: for every interface (0.0.0.0),
    this host's own, which peers on other hosts can reach."""
    return socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "*") else host


_BIND_KEYS = {"host": "", "port": ""}
"""The flags or recipe keys that set the interface and port this process binds (named by bind errors)."""


def name_bind_keys(host: str, port: str = "") -> None:
    """Say which flag or recipe key sets the host (and the port, where the user chooses one) of
    the sockets this process binds, so that a failed bind names what to change. Each serving
    command calls it before it binds: ``name_bind_keys("--host or cache.host", "--port or cache.port")``."""
    _BIND_KEYS.update(host=host, port=port)


def _bind(sock: zmq.Socket, host: str, port: int) -> str:
    address = f"tcp://{host}:{port or '*'}"
    try:
        if port:
            sock.bind(address)
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise bind_error(address, e) from None
    return f"tcp://{advertised(host)}:{port}"


def bind_error(address: str, e: zmq.ZMQError) -> ConfigError:
    """One line for a bind that failed: the address, why, and the flag or key to change. A usage
    error (exit 2), as the HTTP listener's is (rlcli.infer.http): the user picks another port or host."""
    if e.errno == errno.EADDRINUSE:
        return ConfigError(f"cannot bind {address}: the address is already in use; change "
                           f"{_BIND_KEYS['port'] or 'the port'} (0 picks a free port)")
    reason = e.strerror.split(" (addr=")[0]
    return ConfigError(f"cannot bind {address} ({reason}); set {_BIND_KEYS['host'] or 'the host'} to an address "
                       "of this host (127.0.0.1, or 0.0.0.0 for every interface)")


_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):([0-9]{1,5})")


def check_endpoint(endpoint: str, flag: str = "--connect") -> str:
    """``endpoint`` if it has the form tcp://HOST:PORT that rlcli's servers listen on; a
    ConfigError naming ``flag`` otherwise."""
    m = _ENDPOINT.fullmatch(endpoint)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise ConfigError(f"{flag} {endpoint!r} is not an endpoint; expected tcp://HOST:PORT "
                          "(e.g. tcp://127.0.0.1:5555)")
    return endpoint


def check_timeout(timeout: float, flag: str = "--timeout") -> None:
    """A ConfigError naming ``flag`` unless ``timeout`` is a positive number of seconds (a zero or
    negative one would report a live peer as unreachable)."""
    if not 0 < timeout <= 1e6:  # NaN and inf too (zmq's poll takes milliseconds as a C int)
        raise ConfigError(f"{flag} must be > 0 and at most 1e6 seconds, got {timeout:g}")


def _connect(sock: zmq.Socket, endpoint: str) -> None:
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        raise ConfigError(f"cannot connect to {endpoint!r} ({e.strerror.split(' (addr=')[0]}); an endpoint "
                          "looks like tcp://HOST:PORT (check --connect)") from None


class RpcServer:
    """ROUTER socket serving request/reply.

    Contract: requests from any number of DEALER clients are queued up to ``hwm`` per
    client; replies go back to the client identity that sent the request, and are dropped
    if that client has gone (a restarted client re-sends what it still needs). A message
    that is not a valid rlcli message of this protocol version (malformed msgpack, unknown
    type, other protocol version, a tensor whose bytes do not match its dtype and shape), or
    that is larger than ``max_message_bytes``, gets an :class:`ErrorReply` and the server
    keeps running; past twice that size ZeroMQ disconnects the sender.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, hwm: int = DEFAULT_HWM,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.sock = context().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Past twice the limit ZeroMQ drops the connection itself, so one peer cannot make the
        # server buffer arbitrary amounts; up to that, oversized messages get an ErrorReply.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
        self.max_message_bytes = max_message_bytes
        self.endpoint = _bind(self.sock, host, port)

    def recv(self, timeout_ms: int = 0) -> tuple[bytes, Message] | None:
        """The next valid request as (client identity, message), or None after ``timeout_ms``.
        Invalid messages are answered with an ErrorReply and skipped."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            remaining = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.sock.poll(remaining, zmq.POLLIN):
                return None
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) < 2:
                continue
            identity, payload = frames[0], frames[-1]
            if len(payload) > self.max_message_bytes:
                self.reply(identity, ErrorReply(message=f"message of {len(payload)} bytes exceeds this server's "
                                                        f"limit of {self.max_message_bytes} bytes"))
                continue
            try:
                return identity, decode(payload)
            except ValueError as e:
                request_id = ""
                try:
                    request_id = decode_envelope(payload).request_id
                except Exception:
                    pass
                self.reply(identity, ErrorReply(request_id=request_id, message=str(e)))

    def reply(self, identity: bytes, msg: Message) -> None:
        try:
            self.sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # the client's queue is full or it is gone; it will retry

    def close(self) -> None:
        self.sock.close(linger=0)


class RpcClient:
    """DEALER socket to one :class:`RpcServer`.

    Contract: requests are pipelined (many may be in flight); replies arrive in any order
    and are matched by ``request_id``. With ``ZMQ_IMMEDIATE`` a request is only queued on a
    completed connection, so sending to a peer that is down fails fast (``send`` returns
    False) instead of queueing forever. ZeroMQ reconnects by itself when a server comes
    back on the same endpoint, but requests in flight at its death are lost: the caller
    re-sends them (see the orchestrator's probes and incarnation checks).
    """

    def __init__(self, endpoint: str, hwm: int = DEFAULT_HWM):
        self.endpoint = endpoint
        self.sock = context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        try:
            _connect(self.sock, endpoint)
        except ConfigError:
            self.sock.close(linger=0)
            raise
        self._pending: dict[str, Message] = {}

    def send(self, msg: Message, timeout_s: float = 0.0) -> bool:
        """Queue ``msg``; retry for up to ``timeout_s`` while no connection is up."""
        data = encode(msg)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.send(data, zmq.NOBLOCK)
                return True
            except zmq.Again:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.01)

    def recv(self, timeout_ms: int = 0) -> Message | None:
        """The next reply, or None after ``timeout_ms``. Undecodable replies become ErrorReply."""
        if self._pending:
            return self._pending.pop(next(iter(self._pending)))
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return None
        payload = self.sock.recv(zmq.NOBLOCK)
        try:
            return decode(payload)
        except ValueError as e:
            return ErrorReply(message=f"bad reply from {self.endpoint}: {e}")

    def call(self, msg: Message, timeout_s: float = 10.0, peer: str = "peer") -> Message:
        """Send ``msg`` and wait for the reply with its ``request_id``; other replies that
        arrive meanwhile are kept for :meth:`recv`. Raises PeerUnreachable on timeout."""
        request_id = getattr(msg, "request_id")
        deadline = time.monotonic() + timeout_s
        if not self.send(msg, timeout_s):
            raise PeerUnreachable(f"cannot reach {peer} at {self.endpoint} (is it running? check --connect)")
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerUnreachable(f"{peer} at {self.endpoint} did not answer within {timeout_s:.0f}s")
            if not self.sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                continue
            reply = decode(self.sock.recv(zmq.NOBLOCK))
            if getattr(reply, "request_id", None) == request_id:
                return reply
            self._pending[getattr(reply, "request_id", "") or new_request_id()] = reply

    def close(self) -> None:
        self.sock.close(linger=0)


class Publisher:
    """PUB socket for announcements.

    Contract: fire-and-forget to the subscribers connected at the time of sending; a
    subscriber that joins late or is slower than ``hwm`` messages misses them, and catches
    up from the run directory (every announcement states a fact that is already on disk).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, hwm: int = 1000):
        self.sock = context().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.endpoint = _bind(self.sock, host, port)

    def publish(self, msg: Message) -> None:
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self.sock.close(linger=0)


class Subscriber:
    """SUB socket receiving every announcement of the publishers it is connected to.

    Contract: see :class:`Publisher`; messages that fail to decode are skipped. Connect
    more endpoints at any time (e.g. when a publisher appears in the registry).
    """

    def __init__(self, endpoints: Iterable[str] = ()):
        self.sock = context().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.connected: set[str] = set()
        for endpoint in endpoints:
            self.connect(endpoint)

    def connect(self, endpoint: str) -> None:
        if endpoint not in self.connected:
            _connect(self.sock, endpoint)
            self.connected.add(endpoint)

    def disconnect(self, endpoint: str) -> None:
        if endpoint in self.connected:
            self.sock.disconnect(endpoint)
            self.connected.discard(endpoint)

    def recv(self, timeout_ms: int = 0) -> Message | None:
        while self.sock.poll(timeout_ms, zmq.POLLIN):
            try:
                return decode(self.sock.recv(zmq.NOBLOCK))
            except ValueError:
                timeout_ms = 0
        return None

    def close(self) -> None:
        self.sock.close(linger=0)
