"""The orchestrator's view of the inference servers: dispatch, replies, failures.

Servers come from RUN/registry (or fixed ``--connect`` endpoints). Each request goes to
the server with the fewest outstanding sequences. A request is *lost* when its server
leaves the registry, restarts (new incarnation: ZeroMQ reconnects on its own, but what
was in flight died with the process) or does not answer within ``request_timeout_s``;
lost requests are handed back to the caller to re-dispatch.

Split roles (servers registered with ``role`` prefill and decode, see ``up.num_prefill``):
a request goes first to the least loaded prefill server, which answers once the prompt's
KV is in the shared store; its answer is not the caller's. The same request then goes to
the least loaded decode server, which pulls that KV and generates; that answer is. With
no prefill (or no decode) server live, every server is used as a mixed one.
"""

import time
from dataclasses import dataclass

import zmq

from rlcli.errors import PeerUnreachable
from rlcli.protocol import AbortRequests, ErrorReply, GenerateRequest, GenerateResponse, HealthRequest, HealthResponse
from rlcli.transport.registry import list_entries
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcClient, new_request_id


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


class InferPool:
    def __init__(self, run: RunDir, connect: list[str], request_timeout_s: float):
        self.run = run
        self.fixed = list(connect)
        self.timeout_s = request_timeout_s
        self.servers: dict[str, ServerHandle] = {}
        self.outstanding: dict[str, Outstanding] = {}
        for i, endpoint in enumerate(self.fixed):
            self.servers[f"connect-{i}"] = ServerHandle(f"connect-{i}", endpoint)

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
        live = {e.key: e for e in list_entries(self.run.registry_dir(), "infer")}
        gone = [k for k, s in self.servers.items() if k not in live or live[k].incarnation != s.incarnation]
        for key in gone:
            self.servers.pop(key).client.close()
        for key, entry in live.items():
            if key not in self.servers:
                self.servers[key] = ServerHandle(key, entry.endpoints["rpc"], entry.incarnation,
                                                 entry.info.get("role", "mixed"))
        return self._drop(lambda o: o.server in gone)

    def expired(self) -> list[GenerateRequest]:
        now = time.monotonic()
        return self._drop(lambda o: now - o.sent > self.timeout_s)

    def _drop(self, pred) -> list[GenerateRequest]:
        lost = [rid for rid, o in self.outstanding.items() if pred(o)]
        out = []
        for rid in lost:
            o = self.outstanding.pop(rid)
            if o.server in self.servers:
                self.servers[o.server].num_outstanding -= o.request.sampling.n
            out.append(o.request)
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
            self.servers[key].client.send(AbortRequests(request_ids=rids))

    def _hand_off(self, request: GenerateRequest) -> None:
        """Send a prefilled request to a decode server, or keep it for the next poll (it
        expires like any request if no decode server takes it)."""
        waiting = self.outstanding.get(request.request_id)
        if not self.submit(request, stage="decode") and waiting is None:
            self.outstanding[request.request_id] = Outstanding(request, HANDOFF, time.monotonic())

    def _split(self) -> bool:
        roles = {s.role for s in self.servers.values()}
        return "prefill" in roles and "decode" in roles

    def submit(self, request: GenerateRequest, stage: str = "") -> bool:
        """Send to the least loaded server (of the prefill role first, when roles are split;
        ``stage`` "decode" for the second hop); False when no server can take it now."""
        split = self._split()
        prefill = split and stage != "decode"
        wanted = ("prefill" if prefill else "decode") if split else None
        for s in sorted(self.servers.values(), key=lambda s: s.num_outstanding):
            if wanted is not None and s.role != wanted:
                continue
            if s.client.send(request):
                s.num_outstanding += request.sampling.n
                self.outstanding[request.request_id] = Outstanding(request, s.key, time.monotonic(), prefill)
                return True
        return False

    def poll(self, timeout_ms: int) -> list[tuple[GenerateRequest, GenerateResponse | ErrorReply]]:
        """Replies that arrived within ``timeout_ms``, paired with their requests."""
        for request in [o.request for o in self.outstanding.values() if o.server == HANDOFF]:
            self._hand_off(request)
        if not self.servers:
            time.sleep(timeout_ms / 1000)
            return []
        poller = zmq.Poller()
        for s in self.servers.values():
            poller.register(s.client.sock, zmq.POLLIN)
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
