"""The orchestrator's view of the inference servers: dispatch, replies, failures.

Servers come from RUN/registry (or fixed ``--connect`` endpoints). Each request goes to
the server with the fewest outstanding sequences, or to the one its caller prefers (the
server that holds an episode's earlier turns in its prefix cache) while that one is not
much busier. Only servers that serve the caller's policy (:meth:`InferPool.serve_at_least`)
or a newer one take requests: one that rl-sync skipped, or that restarted on an older
version, would generate tokens the batches may not take. A request is *lost* when
- its server leaves the registry, or restarts (a new incarnation: ZeroMQ reconnects on its
  own, but what was in flight died with the process);
- its server, asked, says it does not hold it. Every ``PROBE_EVERY_S`` (or
  ``request_timeout_s`` if shorter) the pool sends each server with requests in flight a
  :class:`HealthRequest` listing them; the answer names those the server does not hold;
- its server has not answered such a question for ``request_timeout_s``. Its requests are
  aborted there, so they stop decoding.
Lost requests are handed back to the caller to re-dispatch. A request its server holds is
never given up, however long it decodes: a 100k-token completion may take an hour.

Request ids start with ``<owner>.<incarnation>.``: on first contact with a server the
pool aborts every request of the same owner but another incarnation, so a restarted
orchestrator frees the servers of its dead predecessor's requests.

Split roles (servers registered with ``role`` prefill and decode, see ``up.num_prefill``):
a request goes first to the least loaded prefill server, which answers once the prompt's
KV is in the shared store; its answer is not the caller's. The same request then goes to
the least loaded decode server, which pulls that KV and generates; that answer is. With
no prefill server live, decode servers serve as mixed ones; with only prefill servers live,
requests wait (a prefill server's one-token answer is never a caller's; before this, the first
steps of a run whose decode server registered late trained on one-token completions). A
prefilled request that no decode server takes within ``request_timeout_s`` is lost.
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
PROBE_EVERY_S = 10.0  # how often a server with requests in flight is asked which it holds
# A preferred server takes a request unless it holds this many sequences more than the least loaded
# one, and half as many again (SGLang's router balances its cache-aware choice alike).
AFFINITY_SLACK = 32


@dataclass
class Outstanding:
    request: GenerateRequest
    server: str
    sent: float
    prefill: bool = False  # at a prefill server; the answer sends it on to a decode server


@dataclass
class Probe:
    """A question to a server: which of these requests do you hold?"""
    request_id: str
    sent: float


class ServerHandle:
    def __init__(self, key: str, endpoint: str, incarnation: str = "", role: str = "mixed"):
        self.key, self.endpoint, self.incarnation, self.role = key, endpoint, incarnation, role
        self.client = RpcClient(endpoint)
        self.num_outstanding = 0  # sequences, not requests
        self.greeting: AbortRequests | None = None  # sent once the connection is up, before any request
        self.probe: Probe | None = None  # unanswered
        self.last_probe = time.monotonic()
        self.version: int | None = None  # the policy it serves, from the registry (None: --connect, unknown)

    def send(self, msg) -> bool:
        if self.greeting is not None:
            if not self.client.send(self.greeting):
                return False
            self.greeting = None
        return self.client.send(msg)


class InferPool:
    def __init__(self, run: RunDir, connect: list[str], request_timeout_s: float, owner: str = "orchestrate-0",
                 label: str = ""):
        """``label``: named before a server in the pool's log lines ("the teacher's ": its servers have the
        same keys as the run's own)."""
        self.run, self.label = run, label
        self.fixed = list(connect)
        self.timeout_s = request_timeout_s
        self.owner, self.prefix = owner, f"{owner}.{uuid.uuid4().hex[:8]}."
        self.servers: dict[str, ServerHandle] = {}
        self.outstanding: dict[str, Outstanding] = {}
        self.entries: dict[str, object] = {}  # key -> registry Entry seen when the server joined
        self.probe_every_s = min(request_timeout_s, PROBE_EVERY_S)
        self.policy = -1  # the oldest policy a server may serve and be sent requests
        self.next_behind_log = 0.0
        self.found_lost: list[Outstanding] = []  # named by a server's answer, for the next lost()
        for i, endpoint in enumerate(self.fixed):
            self._add(ServerHandle(f"connect-{i}", endpoint))

    def new_request_id(self) -> str:
        return self.prefix + uuid.uuid4().hex[:16]

    def _add(self, s: ServerHandle) -> None:
        self.servers[s.key] = s
        # Whatever an earlier incarnation of this owner left running there is unwanted now.
        s.greeting = AbortRequests(request_ids=[], prefix=f"{self.owner}.", except_prefix=self.prefix)

    def check_reachable(self, timeout_s: float | None = None) -> None:
        """Fail fast on fixed endpoints nobody answers on (within 10 s, or ``request_timeout_s`` if
        shorter); learn each one's role (prefill, decode, mixed)."""
        timeout_s = timeout_s if timeout_s is not None else min(10.0, self.timeout_s)
        for s in self.servers.values():
            reply = s.client.call(HealthRequest(request_id=new_request_id()), timeout_s, peer="rl-infer")
            if not isinstance(reply, HealthResponse):
                raise PeerUnreachable(f"{s.endpoint} is not an rl-infer server")
            s.role = reply.infer_role or "mixed"

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
            log.warning("%s%s; re-dispatching its %d request(s)", self.label,
                        describe_gone(self.entries.pop(key), every.get(key)), n)
        for key, entry in live.items():
            if key not in self.servers:
                self._add(ServerHandle(key, entry.endpoints["rpc"], entry.incarnation, entry.info.get("role", "mixed")))
                self.entries[key] = entry
            self.servers[key].version = int(entry.info.get("version", -1))
        return [o.request for o in lost]

    def serve_at_least(self, policy: int) -> None:
        """Send requests only to servers that serve ``policy`` or newer (their registry entries,
        read again now: rl-sync announces a policy after its servers registered it)."""
        if policy <= self.policy:
            return
        self.policy = policy
        if not self.fixed:
            for entry in list_entries(self.run.registry_dir(), "infer"):
                s = self.servers.get(entry.key)
                if s is not None and s.incarnation == entry.incarnation:
                    s.version = int(entry.info.get("version", -1))

    def lost(self) -> list[GenerateRequest]:
        """Requests lost on servers still registered: those a server said it does not hold, all of
        a server's that has not answered a probe for ``request_timeout_s`` (aborted there), and
        prefilled ones no decode server took in that time. Sends the probes that are due."""
        now = time.monotonic()
        lost, self.found_lost = self.found_lost, []
        lost += self._drop(lambda o: o.server == HANDOFF and now - o.sent > self.timeout_s)
        for s in self.servers.values():
            if s.probe is not None and now - s.probe.sent > self.timeout_s:
                silent = self._drop(lambda o: o.server == s.key)
                s.probe = None
                if silent:
                    log.warning("%s%s has not said in %.0fs which requests it holds; aborted its %d request(s) "
                                "there, re-dispatching", self.label, s.key, self.timeout_s, len(silent))
                    s.send(AbortRequests(request_ids=[o.request.request_id for o in silent]))
                lost += silent
            elif s.probe is None and s.num_outstanding and now - s.last_probe >= self.probe_every_s:
                mine = [rid for rid, o in self.outstanding.items() if o.server == s.key]
                probe = Probe(new_request_id(), now)
                if s.send(HealthRequest(request_id=probe.request_id, request_ids=mine)):
                    s.probe, s.last_probe = probe, now
        return [o.request for o in lost]

    def _answered(self, s: ServerHandle, reply: HealthResponse) -> None:
        """A probe's answer: what ``s`` was sent before the probe and does not hold is lost (a
        reply sent before the answer has already been taken: one socket keeps their order)."""
        sent, s.probe = s.probe.sent, None
        unknown = set(reply.unknown)
        gone = self._drop(lambda o: o.server == s.key and o.request.request_id in unknown and o.sent <= sent)
        if gone:
            log.warning("%s%s does not hold %d request(s) sent to it (lost on the way); re-dispatching", self.label,
                        s.key, len(gone))
            self.found_lost += gone

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

    def submit(self, request: GenerateRequest, stage: str = "", prefer: str = "") -> bool:
        """Send to the least loaded server that can take this hop; False when none can now.

        A request goes first to a prefill server when one is live beside a server that generates
        (decode or mixed); ``stage`` "decode" marks the second hop. A prefill server answers one
        token, so it is never sent a request whose answer is the caller's: with only prefill
        servers live, nothing is sent (the request waits for a decode server to register).

        Servers behind the policy of :meth:`serve_at_least` take nothing. ``prefer`` names a server
        (a reply's, from :meth:`poll`) that takes the request if it can take this hop and holds at most ``AFFINITY_SLACK`` sequences more than the least loaded
        one, plus half of that one's."""
        generating = any(s.role != "prefill" for s in self.servers.values())
        prefill = stage != "decode" and generating and any(s.role == "prefill" for s in self.servers.values())
        hop = [s for s in self.servers.values() if (s.role == "prefill") == prefill]
        able = sorted((s for s in hop if s.version is None or s.version >= self.policy), key=lambda s: s.num_outstanding)
        if hop and not able and time.monotonic() >= self.next_behind_log:
            self.next_behind_log = time.monotonic() + 30
            log.warning("no rl-infer server serves policy v%d yet (%s); requests wait for rl-sync to update one",
                        self.policy, ", ".join(f"{s.key} serves v{s.version}" for s in hop))
        first = self.servers.get(prefer)
        if first in able and first.num_outstanding <= able[0].num_outstanding * 3 // 2 + AFFINITY_SLACK:
            able.remove(first)
            able.insert(0, first)
        for s in able:
            if s.send(request):
                s.num_outstanding += request.sampling.n
                self.outstanding[request.request_id] = Outstanding(request, s.key, time.monotonic(), prefill)
                return True
        return False

    def poll(self, timeout_ms: int, wake: tuple = ()) -> list[tuple[GenerateRequest, GenerateResponse | ErrorReply,
                                                                     str]]:
        """Replies that arrived within ``timeout_ms``, each with its request and the key of the
        server that answered; the wait also ends when one of ``wake`` (sockets or file
        descriptors the caller reads) is readable."""
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
                if isinstance(reply, HealthResponse):
                    if s.probe is not None and reply.request_id == s.probe.request_id:
                        self._answered(s, reply)
                    continue
                o = self.outstanding.pop(getattr(reply, "request_id", ""), None)
                if o is None:
                    continue  # a reply to a request already re-dispatched
                s.num_outstanding -= o.request.sampling.n
                if o.prefill and isinstance(reply, GenerateResponse):
                    self._hand_off(o.request)
                    continue
                out.append((o.request, reply, s.key))
        return out

    def close(self) -> None:
        for s in self.servers.values():
            s.client.close()
