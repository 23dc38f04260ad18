"""rl-sync's loop: learn of new weights, have every rl-infer load them, announce the policy.

Sources of truth, fastest first: the trainer's ``WeightsPublished`` (PUB/SUB), then a
scan of RUN/weights for STABLE markers every ``poll_interval_s`` (covers a missed
announcement or a restart of either side). Servers come from RUN/registry; a server
that restarted (new incarnation) reports the version it loaded at start.

Once every live server acknowledged version v, rl-sync records it in
RUN/progress/sync.json and publishes ``PolicyUpdated(v)``: from then on the orchestrator
salts new requests with v. Weight directories older than the newest ``keep_weights``
are deleted, never one a server still serves or loads.

The transport is a backend: ``filesystem`` tells servers to read RUN/weights/step_N.
An NCCL broadcast backend plugs in at :meth:`Syncer.push`.
"""

import time

import zmq

from rlcli.config import RecipeConfig
from rlcli.logging import setup_logging
from rlcli.process import stop_on_signals
from rlcli.protocol import ErrorReply, FsWeights, LoadWeights, PolicyUpdated, WeightsLoaded, WeightsPublished
from rlcli.transport.atomic import remove_dir
from rlcli.transport.registry import Entry, Registration, list_entries
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import Publisher, RpcClient, Subscriber, new_request_id

log = setup_logging("rl-sync")


class Server:
    """What rl-sync knows of one rl-infer process."""

    def __init__(self, entry: Entry):
        self.entry = entry
        self.client = RpcClient(entry.endpoints["rpc"])
        self.version = int(entry.info.get("version", -1))
        self.pending: tuple[str, int, float] | None = None  # (request_id, version, sent at)

    def close(self) -> None:
        self.client.close()


class Syncer:
    def __init__(self, cfg: RecipeConfig, run: RunDir):
        self.cfg, self.run = cfg, run
        self.sub = Subscriber()
        self.pub = Publisher(cfg.infer.host, 0)
        self.registration = Registration(run.registry_dir(), "sync", 0, {"pub": self.pub.endpoint})
        self.servers: dict[str, Server] = {}
        self.target = -1
        self.policy_version = int(run.read_progress("sync").get("version", -1))
        self.stopping = False
        self._next_scan = 0.0

    def scan(self) -> None:
        """Refresh the trainer endpoint, the server set and the newest STABLE weights."""
        for entry in list_entries(self.run.registry_dir(), "train"):
            self.sub.connect(entry.endpoints["pub"])
        live = {e.key: e for e in list_entries(self.run.registry_dir(), "infer")}
        for key in list(self.servers):
            if key not in live or live[key].incarnation != self.servers[key].entry.incarnation:
                log.info("%s %s", key, "left" if key not in live else "restarted")
                self.servers.pop(key).close()
        for key, entry in live.items():
            if key not in self.servers:
                self.servers[key] = Server(entry)
                log.info("%s joined at %s serving v%d", key, entry.endpoints["rpc"], self.servers[key].version)
        latest = self.run.latest_stable("weights")
        if latest is not None:
            self.target = max(self.target, latest)

    def push(self) -> None:
        """Ask every server behind the target to load it (filesystem transport)."""
        now = time.monotonic()
        path = str(self.run.resolve_weights(self.target)) if self.target >= 0 else ""
        for key, s in self.servers.items():
            if s.pending and now - s.pending[2] > self.cfg.sync.ack_timeout_s:
                log.warning("%s did not acknowledge v%d within %.0fs; retrying", key, s.pending[1],
                            self.cfg.sync.ack_timeout_s)
                s.pending = None
            if s.pending is None and s.version < self.target:
                rid = new_request_id()
                if s.client.send(LoadWeights(request_id=rid, version=self.target, weights=FsWeights(path=path))):
                    s.pending = (rid, self.target, now)

    def collect(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for acknowledgements or announcements, then handle all of them."""
        poller = zmq.Poller()
        poller.register(self.sub.sock, zmq.POLLIN)
        for s in self.servers.values():
            poller.register(s.client.sock, zmq.POLLIN)
        if not poller.poll(timeout_ms):
            return
        for key, s in self.servers.items():
            while (reply := s.client.recv(0)) is not None:
                if not (s.pending and getattr(reply, "request_id", None) == s.pending[0]):
                    continue
                if isinstance(reply, WeightsLoaded):
                    s.version = max(s.version, reply.version)
                    log.info("%s loaded v%d in %.2fs", key, reply.version, reply.load_time_s)
                elif isinstance(reply, ErrorReply):
                    log.error("%s failed to load v%d: %s", key, s.pending[1], reply.message)
                s.pending = None
        while (msg := self.sub.recv(0)) is not None:
            if isinstance(msg, WeightsPublished):
                self.target = max(self.target, msg.step)

    def announce(self) -> None:
        if not self.servers:
            return
        version = min(s.version for s in self.servers.values())
        if version > self.policy_version:
            self.policy_version = version
            self.run.write_progress("sync", version=version)
            self.pub.publish(PolicyUpdated(version=version))
            self.registration.update(version=version)
            log.info("policy v%d live on %d server(s)", version, len(self.servers))
            self.retain()

    def retain(self) -> None:
        keep = self.cfg.sync.keep_weights
        in_use = min([self.policy_version] + [s.version for s in self.servers.values()]
                     + [s.pending[1] for s in self.servers.values() if s.pending])
        steps = self.run.stable_steps("weights")
        for step in steps[:-keep] if keep else []:
            if step < in_use:
                remove_dir(self.run.weights_dir(step))

    def loop(self) -> None:
        while not self.stopping:
            if time.monotonic() >= self._next_scan:
                self.scan()
                self._next_scan = time.monotonic() + self.cfg.sync.poll_interval_s
            self.push()
            self.collect(50)
            self.announce()

    def close(self) -> None:
        for s in self.servers.values():
            s.close()
        self.sub.close()
        self.pub.close()
        self.registration.close()


def run(cfg: RecipeConfig, rundir: RunDir) -> int:
    syncer = Syncer(cfg, rundir)
    stop_on_signals(lambda: setattr(syncer, "stopping", True))
    try:
        syncer.loop()
    finally:
        syncer.close()
    return 0
