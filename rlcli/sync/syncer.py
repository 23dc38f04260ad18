"""rl-sync's loop: learn of new weights, have every rl-infer load them, announce the policy.

rl-sync holds no weights: the trainer's ranks publish them (``rlcli.train.publish``) and
the servers load them; rl-sync orders the loads, collects acknowledgements and
announces. Sources of truth, fastest first: the trainer's ``WeightsPublished`` (PUB/SUB),
then a scan of RUN/weights for STABLE markers every ``poll_interval_s`` (covers a missed
announcement or a restart of either side); in collective mode, the trainer's
``ctl/published`` key in rl-sync's store. Servers come from RUN/registry; a server that
restarted (new incarnation) reports the version it loaded at start.

Bounded waits: a server that has not acknowledged a load within ``sync.ack_timeout_s`` is
skipped (one log line naming it): PolicyUpdated no longer waits for it, and nothing is
re-sent to it (no retry storm). Its first answer afterwards re-admits it (with the filesystem
transports, only a load that succeeds does); if it is still behind it gets the next load.
With the filesystem transports, a server that answers with an error (it refused damaged
weights, say) is asked again after a backoff that doubles from ``poll_interval_s`` up to
``ack_timeout_s`` (at once for a newer version); once it has failed for ``ack_timeout_s`` it
is skipped too, and still retried. In collective mode a failed round fails all its members
alike, so an error skips no one; the next round starts ``poll_interval_s`` later.
Once every admitted server acknowledged version v, rl-sync records it in
RUN/progress/sync.json and publishes ``PolicyUpdated(v)``. Weight directories older than the
newest ``keep_weights`` are deleted then and whenever a server moves on, never one a server
still serves or loads.

Transports (``sync.backend.kind``): ``filesystem`` and ``async_filesystem`` tell servers to
read RUN/weights/step_N; ``collective`` runs rounds over a transfer group (``rounds.py``).
"""

import time

import zmq

from rlcli.config import RecipeConfig
from rlcli.config.recipe import shared_settings
from rlcli.logging import setup_logging
from rlcli.process import stop_on_signals
from rlcli.protocol import ErrorReply, FsWeights, LoadWeights, PolicyUpdated, WeightsLoaded, WeightsPublished
from rlcli.sync.status import write_status
from rlcli.transport.atomic import clean_temporaries
from rlcli.transport.pins import prune_weights
from rlcli.transport.registry import Entry, Registration, describe_gone, list_entries
from rlcli.transport.rundir import RunDir, retired
from rlcli.transport.zmq import Publisher, RpcClient, Subscriber, new_request_id

log = setup_logging("rl-sync")


class Server:
    """What rl-sync knows of one rl-infer process."""

    def __init__(self, entry: Entry):
        self.entry = entry
        self.client = RpcClient(entry.endpoints["rpc"])
        self.version = int(entry.info.get("version", -1))
        self.receivers = max(1, int(entry.info.get("receivers", 1)))  # its ranks in a collective round
        self.pending: tuple[str, int, float] | None = None  # (request_id, version, sent at)
        self.skipped = False
        self.last_error = ""
        self.load_s = 0.0
        self.failures = 0  # consecutive error replies
        self.failing_since: float | None = None  # the first of them
        self.retry_at = 0.0  # no load of the same version is sent before this (the backoff after an error)
        self.failed_version = -1

    def failed(self, version: int, now: float, poll_s: float, cap_s: float) -> None:
        """An error reply: the next attempt waits ``poll_s * 2**(failures - 1)``, at most ``cap_s``,
        unless a newer version comes first."""
        self.failures += 1
        self.failed_version = version
        self.failing_since = self.failing_since if self.failing_since is not None else now
        self.retry_at = now + min(poll_s * 2 ** min(self.failures - 1, 30), cap_s)

    def loaded(self) -> None:
        self.failures, self.failing_since, self.retry_at = 0, None, 0.0

    def close(self) -> None:
        self.client.close()


class Syncer:
    def __init__(self, cfg: RecipeConfig, run: RunDir):
        self.cfg, self.run = cfg, run
        self.kind = type(cfg.sync.backend).__struct_config__.tag
        self.sub = Subscriber()
        self.pub = Publisher(cfg.sync.host, 0)
        self.servers: dict[str, Server] = {}
        self.target = -1
        self.policy_version = int(run.read_progress("sync").get("version", -1))
        self.stopping = False
        self._next_scan = 0.0
        self.published_at: dict[int, tuple[float, dict]] = {}  # version -> (time seen, trainer timing)
        self.last_update: dict = {}
        self.rounds = None
        self._poller: zmq.Poller | None = None  # the subscriber and every server's socket; rebuilt when they change
        self._retain_due = False  # a server moved on: weights it held may go
        self._said_missing: set[str] = set()  # what say_what_is_missing said is missing, until it is not
        endpoints = {"pub": self.pub.endpoint}
        if self.kind == "collective":
            from rlcli.sync.rounds import Rounds

            self.rounds = Rounds(self)
            endpoints["store"] = self.rounds.addr
        self.registration = Registration(run.registry_dir(), "sync", 0, endpoints,
                                         {"settings": shared_settings(cfg, "sync")})
        clean_temporaries(run.root / "weights")  # a version an earlier rl-sync was pruning when killed

    # ------------------------------------------------------------------ membership
    def scan(self) -> None:
        """Refresh the trainer endpoint, the server set and the newest STABLE weights."""
        for entry in list_entries(self.run.registry_dir(), "train"):
            self.sub.connect(entry.endpoints["pub"])
        live = {e.key: e for e in list_entries(self.run.registry_dir(), "infer")}
        every = {e.key: e for e in list_entries(self.run.registry_dir(), "infer", alive_only=False)}
        for key in list(self.servers):
            if key not in live or live[key].incarnation != self.servers[key].entry.incarnation:
                log.warning("%s; no longer waited for", describe_gone(self.servers[key].entry, every.get(key)))
                self.servers.pop(key).close()
                self._poller = None
                self.membership_changed()
        for key, entry in live.items():
            if key not in self.servers:
                self.servers[key] = Server(entry)
                self._poller = None
                log.info("%s joined at %s serving v%d", key, entry.endpoints["rpc"], self.servers[key].version)
                self.membership_changed()
        if self.kind != "collective":
            latest = self.run.latest_stable("weights")
            if latest is not None:
                self.see_published(latest, {})
        self.say_what_is_missing()

    def say_what_is_missing(self) -> None:
        """One line, when it starts to be so, that no rl-infer is registered or that rl-train has
        published nothing yet; rl-sync is otherwise silent while it waits for either."""
        missing = {}
        if not self.servers:
            missing["infer"] = f"rl-infer servers to register in {self.run.registry_dir()}"
        if self.target < 0 and self.policy_version < 0:
            missing["train"] = "rl-train's first weights" + (" (posted to rl-sync's store)" if self.kind == "collective"
                                                             else f" in {self.run.root / 'weights'}")
        for key in [k for k in missing if k not in self._said_missing]:
            log.info("waiting for %s", missing[key])
        self._said_missing = set(missing)

    def membership_changed(self) -> None:
        if self.rounds is not None:
            self.rounds.new_generation()

    def admitted(self) -> list[Server]:
        return [s for s in self.servers.values() if not s.skipped]

    def see_published(self, version: int, timing: dict) -> None:
        self.target = max(self.target, version)
        if version > self.policy_version:
            seen, known = self.published_at.get(version, (time.monotonic(), {}))
            self.published_at[version] = (seen, timing or known)

    # ------------------------------------------------------------------ filesystem loads
    def push(self) -> None:
        """Ask every admitted server behind the target to load it; skip the ones that
        sit on a load past the deadline."""
        now = time.monotonic()
        for key, s in self.servers.items():
            if s.pending and not s.skipped and now - s.pending[2] > self.cfg.sync.ack_timeout_s:
                self.skip(key, s)
        if self.rounds is not None:
            return self.rounds.step()
        if self.target < 0:
            return
        path = str(self.run.weights_dir(self.target))
        for s in self.servers.values():  # admitted ones, and failing ones skipped (retried, not waited for)
            retry = now >= s.retry_at or self.target > s.failed_version
            if s.pending is None and s.version < self.target and retry and (s.failures or not s.skipped):
                rid = new_request_id()
                if s.client.send(LoadWeights(request_id=rid, version=self.target, weights=FsWeights(path=path))):
                    s.pending = (rid, self.target, now)

    def skip(self, key: str, s: Server) -> None:
        log.warning("%s did not acknowledge v%d within %.0fs; skipped until it answers", key, s.pending[1],
                    self.cfg.sync.ack_timeout_s)
        s.skipped = True
        self.membership_changed()

    def load_failed(self, key: str, s: Server, version: int, message: str, now: float) -> None:
        cfg = self.cfg.sync
        s.failed(version, now, cfg.poll_interval_s, cfg.ack_timeout_s)
        s.last_error = message
        log.error("%s failed to load v%d (%d in a row): %s", key, version, s.failures, message)
        # Collective: a round fails for all of its members together, so an error names no culprit;
        # Rounds retries after poll_interval_s in a new group.
        if self.rounds is None and not s.skipped and now - s.failing_since >= cfg.ack_timeout_s:
            log.warning("%s has failed to load for %.0fs; skipped until a load succeeds", key, now - s.failing_since)
            s.skipped = True
            self.membership_changed()

    def collect(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for acknowledgements or announcements, then handle all of them."""
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(self.sub.sock, zmq.POLLIN)
            for s in self.servers.values():
                self._poller.register(s.client.sock, zmq.POLLIN)
        if not self._poller.poll(timeout_ms):
            return
        now = time.monotonic()
        for key, s in self.servers.items():
            while (reply := s.client.recv(0)) is not None:
                if not (s.pending and getattr(reply, "request_id", None) == s.pending[0]):
                    continue
                if self.rounds is not None:
                    self.rounds.acked(key, reply)
                version, s.pending = s.pending[1], None
                if isinstance(reply, ErrorReply):
                    self.load_failed(key, s, version, reply.message, now)
                    if self.rounds is None:
                        continue  # filesystem: push retries it; a load that succeeds re-admits it
                if isinstance(reply, WeightsLoaded):
                    s.version = max(s.version, reply.version)
                    s.load_s, s.last_error = reply.load_time_s, ""
                    s.loaded()
                    self._retain_due = True
                    log.info("%s loaded v%d in %.2fs", key, reply.version, reply.load_time_s)
                if s.skipped:
                    s.skipped = False
                    log.info("%s answers again (serving v%d); re-admitted", key, s.version)
                    self.membership_changed()
        while (msg := self.sub.recv(0)) is not None:
            # Collective: the store is the truth (Rounds.step reads it); the trainer's announcement
            # has only woken this loop to read it without waiting out the poll.
            if isinstance(msg, WeightsPublished) and (msg.path or self.kind != "collective"):
                self.see_published(msg.step, msg.timing)

    # ------------------------------------------------------------------ announce, prune
    def announce(self) -> None:
        admitted = self.admitted()
        if not admitted:
            return
        version = min(s.version for s in admitted)
        if version > self.policy_version:
            self.policy_version = version
            seen, timing = self.published_at.get(version, (None, {}))
            self.last_update = {"version": version, **timing,
                                "load_s": max((s.load_s for s in admitted), default=0.0),
                                "total_s": time.monotonic() - seen if seen is not None else None}
            self.write_status()  # first: whoever learns of v from progress or PolicyUpdated finds it in the status
            self.run.append_metrics("sync", {"step": version, **self.last_update, "time": time.time(),
                                             "num_servers": len(admitted),
                                             "num_skipped": len(self.servers) - len(admitted)})
            self.run.write_progress("sync", version=version)
            self.pub.publish(PolicyUpdated(version=version))
            self.registration.update(version=version)
            total = self.last_update["total_s"]
            log.info("policy v%d live on %d server(s)%s", version, len(admitted),
                     f", {total:.3f}s after rl-sync first saw it" if total is not None else "")
            self.published_at = {v: t for v, t in self.published_at.items() if v > version}
            self._retain_due = True
        if self._retain_due:
            self._retain_due = False
            self.retain()
        self.write_status()

    def write_status(self) -> None:
        write_status(self.run, self.kind, self.policy_version, self.target, self.servers, self.last_update)

    def retain(self) -> None:
        """Prune weights past the newest ``sync.keep_weights`` (sparing milestones, ``sync.keep_weights_every``),
        but none a server uses or loads, and
        not policy 0 while no checkpoint exists: a trainer restarted then builds from it, and without
        it would run the SFT warm-up again and republish versions the servers already served."""
        keep = self.cfg.sync.keep_weights
        in_use = min([self.policy_version] + [s.version for s in self.servers.values()]
                     + [s.pending[1] for s in self.servers.values() if s.pending])
        old = retired(self.run.stable_steps("weights"), keep, self.cfg.sync.keep_weights_every)
        if old and old[0] == 0 and self.run.latest_stable("checkpoints") is None:
            old = old[1:]
        for step in old:
            if step < in_use:
                prune_weights(self.run.weights_dir(step), step)  # spares a version a restarting server pinned

    def loop(self) -> None:
        while not self.stopping:
            self.registration.beat()
            if time.monotonic() >= self._next_scan:
                self.scan()
                self._next_scan = time.monotonic() + self.cfg.sync.poll_interval_s
            self.push()
            self.collect(5 if self.rounds is not None and self.rounds.busy() else 50)
            self.announce()

    def close(self) -> None:
        for s in self.servers.values():
            s.close()
        self.sub.close()
        self.pub.close()
        self.registration.close()
        if self.rounds is not None:
            self.rounds.close()


def run(cfg: RecipeConfig, rundir: RunDir) -> int:
    syncer = Syncer(cfg, rundir)
    stop_on_signals(lambda: setattr(syncer, "stopping", True))
    try:
        syncer.loop()
    finally:
        syncer.close()
    return 0
