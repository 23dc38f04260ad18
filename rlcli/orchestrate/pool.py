"""The orchestrator's view of the inference servers: dispatch, replies, failures.

Servers come from RUN/registry (or fixed ``--connect`` endpoints). Each request goes to
the server with the fewest outstanding sequences. A request is *lost* when its server
leaves the registry, restarts (new incarnation: ZeroMQ reconnects on its own, but what
was in flight died with the process) or does not answer within ``request_timeout_s``;
lost requests are handed back to the caller to re-dispatch.
"""

import time
from dataclasses import dataclass

import zmq

from rlcli.errors import PeerUnreachable
from rlcli.protocol import AbortRequests, ErrorReply, GenerateRequest, GenerateResponse, HealthRequest, HealthResponse
from rlcli.transport.registry import list_entries
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcClient, new_request_id


@dataclass
class Outstanding:
    request: GenerateRequest
    server: str
    sent: float


class ServerHandle:
    def __init__(self, key: str, endpoint: str, incarnation: str = ""):
        self.key, self.endpoint, self.incarnation = key, endpoint, incarnation
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
                self.servers[key] = ServerHandle(key, entry.endpoints["rpc"], entry.incarnation)
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

    def submit(self, request: GenerateRequest) -> bool:
        """Send to the least loaded server; False when no server can take it now."""
        for s in sorted(self.servers.values(), key=lambda s: s.num_outstanding):
            if s.client.send(request):
                s.num_outstanding += request.sampling.n
                self.outstanding[request.request_id] = Outstanding(request, s.key, time.monotonic())
                return True
        return False

    def poll(self, timeout_ms: int) -> list[tuple[GenerateRequest, GenerateResponse | ErrorReply]]:
        """Replies that arrived within ``timeout_ms``, paired with their requests."""
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
                out.append((o.request, reply))
        return out

    def close(self) -> None:
        for s in self.servers.values():
            s.client.close()
