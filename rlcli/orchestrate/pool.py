"""The orchestrator's view of the inference servers: dispatch, replies, failures.

Servers come from RUN/registry (or fixed ``--connect`` endpoints). Each request goes to
the server with the fewest outstanding sequences. A request is *lost* when its server
leaves the registry, restarts (new incarnation: ZeroMQ reconnects on its own, but what
was in flight died with the process) or does not answer within ``request_timeout_s``;
lost requests are handed back to the caller to re-dispatch. A timed-out request is
also aborted on its server, so it stops decoding.

Request ids start with ``<owner>.<incarnation>.``: on first contact with a server the
pool aborts every request of the same owner but another incarnation, so a restarted
orchestrator frees the servers of its dead predecessor's requests.

Split roles (servers registered with ``role`` prefill and decode, see ``up.num_prefill``):
a request goes first to the least loaded prefill server, which answers once the prompt's
KV is in the shared store; its answer is not the caller's. The same request then goes to
the least loaded decode server, which pulls that KV and generates; that answer is. With
no prefill server live, decode servers serve as mixed ones; with only prefill servers live,
requests wait (a prefill server's one-token answer is never a caller's; before this, the first
steps of a run whose decode server registered late trained on one-token completions).
"""

import logging
import time
import uuid
from dataclasses import dataclass

import zmq

from rlcli.errors import PeerUnreachable
from rlcli.protocol import AbortRequests, ErrorReply, GenerateRequest, GenerateResponse, HealthRequest, HealthResponse
from rlcli.transport.registry import describe_gone, list_entries
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcClient, new_request_id

log = logging.getLogger("rl-orchestrate")


HANDOFF = ""  # the server of a prefilled request no decode server has taken yet


@dataclass
class Outstanding:
    request: GenerateRequest
    server: str
    sent: float
    prefill: bool = False  # at a prefill server; the answer sends it on to a decode server


class ServerHandle:
    def __init__(self, key: str, endpoint: str, incarnation: str = "", role: str = "mixed"):
        self.key, self.endpoint, self.incarnation, self.role = key, endpoint, incarnation, role
        self.client = RpcClient(endpoint)
        self.num_outstanding = 0  # sequences, not requests
        self.greeting: AbortRequests | None = None  # sent once the connection is up, before any request

    def send(self, msg) -> bool:
        if self.greeting is not None:
            if not self.client.send(self.greeting):
                return False
            self.greeting = None
        return self.client.send(msg)


class InferPool:
    def __init__(self, run: RunDir, connect: list[str], request_timeout_s: float, owner: str = "orchestrate-0"):
        self.run = run
        self.fixed = list(connect)
        self.timeout_s = request_timeout_s
        self.owner, self.prefix = owner, f"{owner}.{uuid.uuid4().hex[:8]}."
        self.servers: dict[str, ServerHandle] = {}
        self.outstanding: dict[str, Outstanding] = {}
        self.entries: dict[str, object] = {}  # key -> registry Entry seen when the server joined
        for i, endpoint in enumerate(self.fixed):
            self._add(ServerHandle(f"connect-{i}", endpoint))

    def new_request_id(self) -> str:
        return self.prefix + uuid.uuid4().hex[:16]

    def _add(self, s: ServerHandle) -> None:
        self.servers[s.key] = s
        # Whatever an earlier incarnation of this owner left running there is unwanted now.
        s.greeting = AbortRequests(request_ids=[], prefix=f"{self.owner}.", except_prefix=self.prefix)

    def check_reachable(self, timeout_s: float = 10.0) -> None:
        """Fail fast on fixed endpoints nobody answers on."""
        for s in self.servers.values():
            reply = s.client.call(HealthRequest(request_id=new_request_id()), timeout_s, peer="rl-infer")
            if not isinstance(reply, HealthResponse):
                raise PeerUnreachable(f"{s.endpoint} is not an rl-infer server")

    def refresh(self) -> list[GenerateRequest]:
        """Sync the server set with the registry; requests lost to departed or restarted servers."""
        if self.fixed:
            return []
        every = {e.key: e for e in list_entries(self.run.registry_dir(), "infer", alive_only=False)}
        live = {k: e for k, e in every.items() if e.alive()}
        gone = [k for k, s in self.servers.items() if k not in live or live[k].incarnation != s.incarnation]
        for key in gone:
            self.servers.pop(key).client.close()
        lost = self._drop(lambda o: o.server in gone)
        for key in gone:
            n = sum(1 for o in lost if o.server == key)
            log.warning("%s; re-dispatching its %d request(s)", describe_gone(self.entries.pop(key), every.get(key)), n)
        for key, entry in live.items():
            if key not in self.servers:
                self._add(ServerHandle(key, entry.endpoints["rpc"], entry.incarnation, entry.info.get("role", "mixed")))
                self.entries[key] = entry
        return [o.request for o in lost]

    def expired(self) -> list[GenerateRequest]:
        """Requests unanswered for ``request_timeout_s``: aborted on their server, handed back."""
        now = time.monotonic()
        lost = self._drop(lambda o: now - o.sent > self.timeout_s)
        by_server: dict[str, list[str]] = {}
        for o in lost:
            by_server.setdefault(o.server, []).append(o.request.request_id)
        for key, rids in by_server.items():
            if key in self.servers:
                log.warning("%s did not answer %d request(s) in %.0fs; aborted there, re-dispatching", key,
                            len(rids), self.timeout_s)
                self.servers[key].send(AbortRequests(request_ids=rids))
        return [o.request for o in lost]

    def _drop(self, pred) -> list[Outstanding]:
        out = []
        for rid in [rid for rid, o in self.outstanding.items() if pred(o)]:
            o = self.outstanding.pop(rid)
            if o.server in self.servers:
                self.servers[o.server].num_outstanding -= o.request.sampling.n
            out.append(o)
        return out

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests whose results are no longer wanted, freeing their server's capacity."""
        by_server: dict[str, list[str]] = {}
        for rid in request_ids:
            o = self.outstanding.pop(rid, None)
            if o is not None and o.server in self.servers:
                self.servers[o.server].num_outstanding -= o.request.sampling.n
                by_server.setdefault(o.server, []).append(rid)
        for key, rids in by_server.items():
            self.servers[key].send(AbortRequests(request_ids=rids))

    def _hand_off(self, request: GenerateRequest) -> None:
        """Send a prefilled request to a decode server, or keep it for the next poll (it
        expires like any request if no decode server takes it)."""
        waiting = self.outstanding.get(request.request_id)
        if not self.submit(request, stage="decode") and waiting is None:
            self.outstanding[request.request_id] = Outstanding(request, HANDOFF, time.monotonic())

    def submit(self, request: GenerateRequest, stage: str = "") -> bool:
        """Send to the least loaded server that can take this hop; False when none can now.

        A request goes first to a prefill server when one is live beside a server that generates
        (decode or mixed); ``stage`` "decode" marks the second hop. A prefill server answers one
        token, so it is never sent a request whose answer is the caller's: with only prefill
        servers live, nothing is sent (the request waits for a decode server to register)."""
        generating = any(s.role != "prefill" for s in self.servers.values())
        prefill = stage != "decode" and generating and any(s.role == "prefill" for s in self.servers.values())
        for s in sorted(self.servers.values(), key=lambda s: s.num_outstanding):
            if (s.role == "prefill") != prefill:
                continue
            if s.send(request):
                s.num_outstanding += request.sampling.n
                self.outstanding[request.request_id] = Outstanding(request, s.key, time.monotonic(), prefill)
                return True
        return False

    def poll(self, timeout_ms: int, wake: tuple = ()) -> list[tuple[GenerateRequest, GenerateResponse | ErrorReply]]:
        """Replies that arrived within ``timeout_ms``, paired with their requests; the wait also
        ends when one of ``wake`` (sockets or file descriptors the caller reads) is readable."""
        for request in [o.request for o in self.outstanding.values() if o.server == HANDOFF]:
            self._hand_off(request)
        poller = zmq.Poller()
        for s in self.servers.values():
            poller.register(s.client.sock, zmq.POLLIN)
        for w in wake:
            poller.register(w, zmq.POLLIN)
        if not self.servers and not wake:
            time.sleep(timeout_ms / 1000)
            return []
        poller.poll(timeout_ms)
        out = []
        for s in self.servers.values():
            while (reply := s.client.recv(0)) is not None:
                o = self.outstanding.pop(getattr(reply, "request_id", ""), None)
                if o is None:
                    continue  # a reply to a request already re-dispatched
                s.num_outstanding -= o.request.sampling.n
                if o.prefill and isinstance(reply, GenerateResponse):
                    self._hand_off(o.request)
                    continue
                out.append((o.request, reply))
        return out

    def close(self) -> None:
        for s in self.servers.values():
            s.client.close()
