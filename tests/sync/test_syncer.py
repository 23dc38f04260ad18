"""rl-sync's Syncer against stand-in rl-infer servers (a ROUTER socket and a registry entry each, in
threads): a server that refuses every load is retried with a growing backoff, not once per loop,
is skipped once it has failed for ``ack_timeout_s`` so PolicyUpdated moves on without it, and is
re-admitted by the first load that succeeds; a silent server is skipped, and the weights it serves
or loads are kept until it has moved on."""

import threading
import time

import pytest

from rlcli.config import RecipeConfig
from rlcli.config.services import SyncConfig
from rlcli.protocol import ErrorReply, LoadWeights, WeightsLoaded
from rlcli.sync.status import read_status
from rlcli.sync.syncer import Syncer
from rlcli.transport.atomic import atomic_dir
from rlcli.transport.registry import Registration
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcServer

pytestmark = pytest.mark.timeout(60)


class StandIn:
    """Answers LoadWeights for versions in ``refuse`` with an ErrorReply, others with WeightsLoaded;
    while ``hold`` is set it answers none (a stuck server), and answers them all once it is cleared."""

    def __init__(self, run: RunDir, instance: int, refuse: set[int], hold: bool = False):
        self.refuse, self.hold, self.asked, self.held = refuse, hold, [], []
        self.server = RpcServer()
        self.registration = Registration(run.registry_dir(), "infer", instance, {"rpc": self.server.endpoint},
                                         info={"version": 0})
        self.stopping = False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stopping:
            self.registration.beat()
            got = self.server.recv(20)
            if got is not None and isinstance(got[1], LoadWeights):
                self.asked.append(got[1].version)
                self.held.append(got)
            while self.held and not self.hold:
                identity, msg = self.held.pop(0)
                if msg.version in self.refuse:
                    reply = ErrorReply(request_id=msg.request_id, message=f"v{msg.version} damaged")
                else:
                    reply = WeightsLoaded(request_id=msg.request_id, version=msg.version)
                self.server.reply(identity, reply)

    def stop(self) -> None:
        self.stopping = True
        self.thread.join()
        self.server.close()


def run_until(syncer: Syncer, done, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"rl-sync never reached: {what}"
        syncer.registration.beat()
        syncer.scan()
        syncer.push()
        syncer.collect(20)
        syncer.announce()


def test_a_server_that_refuses_a_version_is_backed_off_skipped_and_readmitted(tmp_path):
    run = RunDir(tmp_path / "run")
    cfg = RecipeConfig(sync=SyncConfig(ack_timeout_s=1.0, poll_interval_s=0.05))
    good, bad = StandIn(run, 0, set()), StandIn(run, 1, {1})
    syncer = Syncer(cfg, run)
    try:
        run_until(syncer, lambda: len(syncer.servers) == 2, "two servers")
        syncer.see_published(1, {})
        start = time.monotonic()
        run_until(syncer, lambda: syncer.policy_version == 1, "PolicyUpdated(1) without the failing server")
        waited = time.monotonic() - start
        assert waited >= cfg.sync.ack_timeout_s  # PolicyUpdated waited for the failing server that long
        assert good.asked == [1]
        # The loop ran every ~20 ms; with no backoff each pass re-sent the load (~50 tries by now). With
        # it the waits double from 0.05 s: tries at ~0, 0.05, 0.15, 0.35, 0.75, 1.55, ... s.
        assert 2 <= len(bad.asked) <= 2 + waited / cfg.sync.poll_interval_s / 4, bad.asked
        status = read_status(run.root)["servers"]["infer-1"]
        assert status["state"] == "skipped" and status["version"] == 0
        assert status["failed_loads"] == len(bad.asked) and status["last_error"] == "v1 damaged"
        # Each policy made live is one record of RUN/metrics/sync.jsonl, the skipped server counted.
        record = run.read_metrics("sync")[-1]
        assert record["step"] == record["version"] == 1 and (record["num_servers"], record["num_skipped"]) == (1, 1)
        assert record["total_s"] >= cfg.sync.ack_timeout_s
        # Skipped, but still asked (at most every ack_timeout_s); a newer version is asked for at once.
        bad.refuse.clear()
        syncer.see_published(2, {})
        # Both servers: announce() waits for every server it does not skip, the good one included.
        run_until(syncer, lambda: all(s.version == 2 for s in syncer.servers.values()), "both servers loading v2")
        assert bad.asked[-1] == 2 and not syncer.servers["infer-1"].skipped
        syncer.announce()
        assert syncer.policy_version == 2
        status = read_status(run.root)["servers"]["infer-1"]
        assert status["state"] == "admitted" and status["failed_loads"] == 0 and status["last_error"] == ""
    finally:
        syncer.close()
        good.stop()
        bad.stop()


def test_a_silent_server_is_skipped_and_the_weights_it_serves_or_loads_are_kept(tmp_path):
    run = RunDir(tmp_path / "run")
    cfg = RecipeConfig(sync=SyncConfig(ack_timeout_s=1.0, poll_interval_s=0.05, keep_weights=1))
    good, stuck = StandIn(run, 0, set()), StandIn(run, 1, set())
    syncer = Syncer(cfg, run)

    def publish(version: int) -> None:
        with atomic_dir(run.weights_dir(version), {"step": version}) as tmp:
            (tmp / "model.safetensors").write_bytes(b"w")
        syncer.see_published(version, {})

    try:
        run_until(syncer, lambda: len(syncer.servers) == 2, "two servers")
        publish(1)
        run_until(syncer, lambda: syncer.policy_version == 1, "PolicyUpdated(1) on both servers")
        stuck.hold = True
        for v in (2, 3, 4):
            publish(v)
        run_until(syncer, lambda: syncer.policy_version == 4, "PolicyUpdated(4) without the silent server")
        assert syncer.servers["infer-1"].skipped and good.asked[-1] == 4
        assert stuck.asked == [1, 4]  # asked for the newest version once, never again while silent
        # It serves v1 and was asked for v4: both stay on disk, though keep_weights is 1.
        assert {1, 4} <= set(run.stable_steps("weights"))
        stuck.hold = False  # it answers at last: re-admitted on v4; v1..v3 can go
        run_until(syncer, lambda: syncer.servers["infer-1"].version == 4, "the silent server back, on v4")
        syncer.announce()
        assert run.stable_steps("weights") == [4]
    finally:
        syncer.close()
        good.stop()
        stuck.stop()


def test_policy_zero_is_kept_until_a_checkpoint_exists(tmp_path):
    """A trainer restarted before its first checkpoint builds from weights/step_0; pruned, the SFT
    warm-up ran again and versions 1.. were trained and published a second time."""
    run = RunDir(tmp_path / "run")
    syncer = Syncer(RecipeConfig(sync=SyncConfig(keep_weights=1)), run)
    try:
        for v in range(4):
            with atomic_dir(run.weights_dir(v), {"step": v}) as tmp:
                (tmp / "model.safetensors").write_bytes(b"w")
        syncer.policy_version = 3
        syncer.retain()
        assert run.stable_steps("weights") == [0, 3]
        with atomic_dir(run.checkpoint_dir(2), {"step": 2}) as tmp:
            (tmp / "state").write_bytes(b"s")
        syncer.retain()
        assert run.stable_steps("weights") == [3]
    finally:
        syncer.close()


def test_on_every_interface_rl_sync_tells_peers_this_hosts_address(tmp_path):
    """sync.host = 0.0.0.0 (Slurm's BIND_HOST): its announcements and the collective store are given as
    an address servers and trainer ranks on other hosts can reach (the store once gave 0.0.0.0)."""
    import socket

    from rlcli.config.services import CollectiveTransport
    from rlcli.transport.collective import connect_store
    from rlcli.transport.rendezvous import read_store_file

    run = RunDir(tmp_path / "run")
    cfg = RecipeConfig(sync=SyncConfig(backend=CollectiveTransport(), host="0.0.0.0"))
    syncer = Syncer(cfg, run)
    try:
        here = socket.gethostbyname(socket.gethostname())
        addr = read_store_file(run.root)["addr"]
        assert addr == syncer.rounds.addr and addr.startswith(f"{here}:")
        assert syncer.pub.endpoint.startswith(f"tcp://{here}:")
        client = connect_store(addr, 10)  # reachable at that address
        client.set("probe", "1")
        assert syncer.rounds.store.get("probe") == b"1"
    finally:
        syncer.close()


def test_what_rl_sync_waits_for_is_said_once_each_time_it_goes_missing(tmp_path, caplog):
    """rl-sync is otherwise silent while nothing is registered or published: one line per missing
    piece when it goes missing, none while it stays missing, one again after it came and went."""
    import logging

    from rlcli.sync import syncer as syncer_module

    run = RunDir(tmp_path / "run")
    syncer = Syncer(RecipeConfig(sync=SyncConfig(poll_interval_s=0.05)), run)
    syncer_module.log.addHandler(caplog.handler)  # setup_logging's basicConfig may have replaced pytest's
    caplog.set_level(logging.INFO)
    server = None

    def said() -> list[str]:
        records = dict.fromkeys(caplog.records)  # a record that reached the handler twice counts once
        lines = [r.getMessage() for r in records if r.getMessage().startswith("waiting for")]
        caplog.clear()
        return lines

    try:
        syncer.scan()
        syncer.scan()
        assert said() == [f"waiting for rl-infer servers to register in {run.registry_dir()}",
                          f"waiting for rl-train's first weights in {run.root / 'weights'}"]
        server = StandIn(run, 0, set())
        run_until(syncer, lambda: syncer.servers, "a server")
        assert said() == []
        server.stop()
        server.registration.close()
        server = None
        run_until(syncer, lambda: not syncer.servers, "the server gone")
        syncer.scan()
        assert said() == [f"waiting for rl-infer servers to register in {run.registry_dir()}"]
    finally:
        syncer_module.log.removeHandler(caplog.handler)
        syncer.close()
        if server is not None:
            server.stop()
