"""Collective updates as rounds: rl-sync's side of ``rlcli.transport.rendezvous``.

rl-sync hosts the store and writes its address to RUN/sync/store.json. A round moves
the trainer's staged version to every admitted server at once:

1. order: ``round/<r>`` = (group ``gen<g>``, world size = 1 + the servers' receivers; with
   several trainer senders, sender k >= 1 has a group of its own of that size, ``gen<g>.s<k>``;
   min_version = the oldest admitted server's version + 1), placed as soon as no round is in
   flight, so it normally waits for the trainer's next version. A server has one receiver
   per process that joins the group (a vLLM engine: one per tensor-parallel worker, which
   take consecutive ranks from the server's first);
2. the trainer takes it the moment it holds a version >= min_version (compare-and-set on
   ``accept/<r>``, then it announces, which wakes this loop); until then rl-sync may
   withdraw it (same key) when membership changes, and orders a new one;
3. every member gets ``LoadWeights(NcclWeights)`` for the version taken, with its rank,
   joins the group of generation g (kept across rounds while membership holds) and receives;
4. the round ends when every member answered and the trainer reported, or at
   ``ack_timeout_s``: members that did not answer are skipped.

The generation is bumped whenever membership changes (join, restart, leave, skip,
re-admit) or a round failed, because a group with a dead, stuck or errored member is
unusable; every member of the next round builds the new group. Collective op deadlines
are half of ``ack_timeout_s``, so live members fail and answer before rl-sync gives up
on the silent ones.
"""

import time

from rlcli.logging import setup_logging
from rlcli.protocol import ErrorReply, LoadWeights, NcclWeights, TensorSpec
from rlcli.transport.collective import host_store
from rlcli.transport.rendezvous import Control, write_store_file
from rlcli.transport.zmq import advertised, new_request_id

log = setup_logging("rl-sync")


def member_ranks(servers: list[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """(each server's first rank, the group's world size) for (key, receivers) pairs in order; the
    trainer's sending rank is 0."""
    members, rank = {}, 1
    for key, receivers in servers:
        members[key] = rank
        rank += receivers
    return members, rank


class Round:
    def __init__(self, r: int, min_version: int, group: str, members: dict[str, int], world_size: int):
        self.r, self.version, self.group, self.members = r, min_version, group, members  # key -> first rank
        self.world_size = world_size
        self.senders = 1  # the trainer's sending ranks, as posted with the version it took
        self.phase = "open"  # then "load" once the trainer took it (self.version: the version it took)
        self.started = self.sent_at = time.monotonic()
        self.acks: dict[str, str] = {}  # key -> "" (ok) or the error
        self.outcome: dict | None = None


class Rounds:
    def __init__(self, syncer):
        self.syncer, self.cfg = syncer, syncer.cfg
        self.store = host_store(self.cfg.sync.host, 0)
        self.addr = f"{advertised(self.cfg.sync.host)}:{self.store.port}"  # the store listens on every interface
        write_store_file(syncer.run.root, self.addr)
        self.ctl = Control(self.store)
        self.generation = 0
        self.next_r = 0
        self.current: Round | None = None
        self.published: dict | None = None
        self.not_before = 0.0  # after a failed round, wait a poll interval (no retry storm)

    def new_generation(self) -> None:
        self.generation += 1

    def busy(self) -> bool:
        """A transfer is in flight (an open order waits for the trainer's announcement instead)."""
        return self.current is not None and self.current.phase == "load"

    def read_published(self) -> None:
        pub = self.ctl.published()
        seen = self.published
        if pub is not None and (seen is None or (pub["version"], pub.get("timing")) != (seen["version"],
                                                                                        seen.get("timing"))):
            # A new version, or its gather time, which the trainer posts once staging is done.
            self.published = pub
            self.syncer.see_published(pub["version"], pub.get("timing") or {})
            if self.syncer.last_update.get("version") == pub["version"]:  # announced before the timing came
                self.syncer.last_update.update(pub.get("timing") or {})

    def step(self) -> None:
        """Advance the round in flight, or order one when no round is open."""
        self.read_published()
        if self.current is None:
            return self._maybe_order()
        rnd, now = self.current, time.monotonic()
        if rnd.phase == "open":
            answer = self.ctl.accepted(rnd.r)
            if isinstance(answer, dict):
                rnd.version, rnd.started = answer["version"], now
                if self.published is None or self.published["version"] != rnd.version:
                    self.read_published()  # the trainer posted it before it took the round
                self._send_loads(rnd)
            elif answer == "withdrawn" or (rnd.group != f"gen{self.generation}" and self.ctl.withdraw(rnd.r)):
                self.current = None  # membership changed: the next step orders for the new one
            return
        if rnd.outcome is None:
            rnd.outcome = self.ctl.outcome(rnd.r)
        waiting = [k for k in rnd.members if k not in rnd.acks]
        if not waiting and rnd.outcome is not None:
            return self._finish(rnd)
        if now - rnd.sent_at > self.cfg.sync.ack_timeout_s:
            for key in waiting:
                s = self.syncer.servers.get(key)
                # A member that restarted mid-round is a new Server that never got this load: not skipped.
                if s is not None and not s.skipped and s.pending is not None:
                    self.syncer.skip(key, s)
            self._finish(rnd)

    def _maybe_order(self) -> None:
        admitted = sorted(self.syncer.admitted(), key=lambda s: s.entry.key)
        if not admitted or any(s.pending for s in admitted) or time.monotonic() < self.not_before:
            return
        members, world_size = member_ranks([(s.entry.key, s.receivers) for s in admitted])
        rnd = Round(self.next_r, min(s.version for s in admitted) + 1, f"gen{self.generation}", members, world_size)
        self.next_r += 1
        self.ctl.order(rnd.r, rnd.version, rnd.group, world_size)
        self.current = rnd

    def _send_loads(self, rnd: Round) -> None:
        pub = self.published
        tensors = [TensorSpec(name=n, dtype=d, shape=list(shape)) for n, d, shape in pub["tensors"]]
        rnd.phase, rnd.sent_at, rnd.senders = "load", time.monotonic(), int(pub.get("senders", 1))
        for key, rank in rnd.members.items():
            s = self.syncer.servers.get(key)
            if s is None:
                rnd.acks[key] = "left"
                continue
            rid = new_request_id()
            ref = NcclWeights(group=rnd.group, tensors=tensors, bucket_bytes=pub["bucket_bytes"], store=self.addr,
                              rank=rank, world_size=rnd.world_size, senders=rnd.senders,
                              timeout_s=self.cfg.sync.ack_timeout_s / 2)
            if s.client.send(LoadWeights(request_id=rid, version=rnd.version, weights=ref)):
                s.pending = (rid, rnd.version, rnd.sent_at)
            else:
                rnd.acks[key] = "unreachable"

    def acked(self, key: str, reply) -> None:
        rnd = self.current
        if rnd is not None and rnd.phase == "load" and key in rnd.members:
            rnd.acks[key] = reply.message if isinstance(reply, ErrorReply) else ""

    def _finish(self, rnd: Round) -> None:
        outcome = rnd.outcome or {"error": "no report from the trainer", "timing": {}}
        failed = bool(outcome["error"]) or any(rnd.acks.get(k, "timeout") for k in rnd.members)
        if failed:
            others = {k: self.ctl.outcome(rnd.r, k) for k in range(1, rnd.senders)}
            others = {k: (o["error"] or "ok") if o else "no report" for k, o in others.items()}
            log.warning("round %d (v%d, %s) failed: trainer %s%s; servers %s", rnd.r, rnd.version, rnd.group,
                        outcome["error"] or "ok", f" (senders 1.. {others})" if others else "",
                        {k: rnd.acks.get(k, "timeout") or "ok" for k in rnd.members})
            self.new_generation()
            self.not_before = time.monotonic() + self.cfg.sync.poll_interval_s
        seen, timing = self.syncer.published_at.get(rnd.version, (None, {}))
        self.syncer.published_at[rnd.version] = (seen or rnd.started, {**timing, **outcome.get("timing", {})})
        if self.syncer.last_update.get("version") == rnd.version:  # announced before the trainer's report came
            self.syncer.last_update.update(outcome.get("timing", {}))
        self.current = None

    def close(self) -> None:
        self.store = None
