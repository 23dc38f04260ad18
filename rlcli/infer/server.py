"""rl-infer's serving loop: one thread drives the engine; ZeroMQ and HTTP feed it.

The loop blocks only when the engine is idle, on a poll over the ZeroMQ request socket
and the HTTP front door's wake-up socket; otherwise it drains both without waiting,
then runs one engine step. A ``LoadWeights`` is therefore applied between two decode
steps: running sequences keep their KV and continue under the new weights. Every reply
goes to the client that sent the request: a ZeroMQ identity, or the HTTP handler's
sink (see :mod:`rlcli.infer.http`). The engine is reached only through the ``Engine``
Protocol (:mod:`rlcli.infer.base`) and built by :func:`rlcli.infer.factory.make_engine`.
"""

import time
from typing import Callable

import msgspec
import zmq

from rlcli.config import RecipeConfig
from rlcli.config.recipe import shared_settings
from rlcli.errors import CorruptFile, PeerUnreachable, RLCLIError
from rlcli.infer.base import Delta, Engine
from rlcli.infer.factory import make_engine
from rlcli.infer.shared_kv import SharedKVMixin
from rlcli.logging import setup_logging
from rlcli.process import stop_on_signals
from rlcli.protocol import (
    AbortRequests, ErrorReply, GenerateRequest, GenerateResponse, HealthRequest, HealthResponse, LoadWeights,
    NcclWeights,
    Shutdown, WeightsLoaded,
)
from rlcli.transport.interval import IntervalCounters, ratio
from rlcli.transport.pins import pin_latest, unpin
from rlcli.transport import registry
from rlcli.transport.registry import Registration, list_entries
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcServer

log = setup_logging("rl-infer")

Sink = Callable[[object], None]  # where an HTTP request's deltas, response or error go


def resolve_kv_cache(cfg: RecipeConfig, run: RunDir, timeout_s: float = 120.0) -> RecipeConfig:
    """``--kv-cache registry``: the run's rl-cache endpoint, waiting for it to register."""
    if cfg.infer.kv_cache.endpoint != "registry":
        return cfg
    deadline = time.monotonic() + timeout_s
    while not (entries := list_entries(run.registry_dir(), "cache")):
        if time.monotonic() > deadline:
            raise PeerUnreachable(f"--kv-cache registry: no rl-cache registered in {run.registry_dir()} "
                                  f"within {timeout_s:.0f}s")
        time.sleep(0.2)
    kv = msgspec.structs.replace(cfg.infer.kv_cache, endpoint=entries[0].endpoints["rpc"])
    return msgspec.structs.replace(cfg, infer=msgspec.structs.replace(cfg.infer, kv_cache=kv))


def wait_for_policy(run: RunDir, poll_s: float = 0.2, skip: set[int] = frozenset()) -> int:
    """The newest complete and intact policy version in RUN/weights (not in ``skip``), waiting for
    the trainer's first one."""
    announced = False
    while (step := run.newest_intact("weights", skip)) is None:
        if not announced:
            log.info("waiting for %s (rl-train writes the initial policy)", run.weights_dir(0))
            announced = True
        time.sleep(poll_s)
    return step


class InferServer:
    def __init__(self, cfg: RecipeConfig, run: RunDir, instance: int):
        cfg = resolve_kv_cache(cfg, run)
        self.cfg, self.run, self.instance = cfg, run, instance
        corrupt: set[int] = set()  # versions whose shards failed their checksum while loading
        while True:
            # Pinned until registered: rl-sync must not prune the version this start is loading.
            version, pinned = pin_latest(run.root, f"infer-{instance}", lambda: wait_for_policy(run, skip=corrupt))
            try:
                self._start(cfg, run, instance, version)
                return
            except CorruptFile as e:
                log.warning("%s; trying the version before", e)
                corrupt.add(version)
            finally:
                unpin(pinned)

    def _start(self, cfg: RecipeConfig, run: RunDir, instance: int, version: int) -> None:
        icfg = cfg.infer
        if icfg.device == "cpu":  # a decode step's large temporaries reuse the last step's pages
            from rlcli.transport.host_memory import keep_freed_memory

            keep_freed_memory()
        weights = run.resolve_weights(version)
        t0 = time.monotonic()
        self.engine: Engine = make_engine(cfg, weights, version, instance)
        self.last_load_s = time.monotonic() - t0  # bounds the liveness promise of the next load
        self.server = RpcServer(icfg.host, icfg.port)
        endpoints = {"rpc": self.server.endpoint}
        self.http = None
        if icfg.http_port >= 0:
            from rlcli.infer.http import HttpFrontDoor

            self.http = HttpFrontDoor(cfg, weights)
            endpoints["http"] = self.http.endpoint
        workers = self.engine.weight_receivers  # rl-sync gives each a rank in collective updates
        self.registration = Registration(run.registry_dir(), "infer", instance, endpoints,
                                         {"version": version, "role": icfg.role, "receivers": workers,
                                          "settings": shared_settings(cfg, "infer")})
        self.registration.take_long_op_notices()  # a kernel's first-use compile inside a step (fp8 backends)
        self.interval = IntervalCounters(icfg.metrics_interval_s)
        self.clients: dict[str, bytes] = {}  # request_id -> ZeroMQ client identity
        self.sinks: dict[str, Sink] = {}  # request_id -> HTTP handler
        self.stopping = False
        self.cores = None  # adaptive threads (rlcli.transport.cores): the native engine on a CPU
        ecfg = icfg.engine
        if ecfg.name == "native" and ecfg.threads == "adaptive" and icfg.device == "cpu" \
                and not cfg.model.batch_invariant:  # batch-invariant numerics run on one thread
            from rlcli.transport.cores import CoreShare

            self.cores = CoreShare(run.root, "infer", instance, ecfg.num_threads)
        log.info("serving policy v%d from %s with the %s engine on %s%s (%s, role %s) in %.1fs", version, weights,
                 icfg.engine.name, icfg.device, f" x{workers} (tensor parallel)" if workers > 1 else "",
                 ", ".join(endpoints.values()), icfg.role, time.monotonic() - t0)
        decode_mode = getattr(self.engine, "decode_mode", None)  # the native engine on CUDA: graphs or not
        if decode_mode and icfg.device != "cpu":
            log.info("decode steps: %s", decode_mode)

    def handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, GenerateRequest):
            try:
                self.engine.add_request(msg)
                self.clients[msg.request_id] = identity
            except ValueError as e:
                self.server.reply(identity, ErrorReply(request_id=msg.request_id, message=str(e)))
        elif isinstance(msg, LoadWeights):
            t0 = time.monotonic()
            # Peers wait this long before calling the server dead: past its usual load, within rl-sync's patience.
            self.registration.beat(busy_s=min(self.cfg.sync.ack_timeout_s, max(registry.STALE_AFTER_S,
                                                                                3 * self.last_load_s)))
            weights = msg.weights
            if isinstance(weights, NcclWeights):  # no message may hold the serving loop past rl-sync's patience
                weights = msgspec.structs.replace(weights, timeout_s=min(weights.timeout_s,
                                                                         self.cfg.sync.ack_timeout_s))
            try:
                self.engine.load_weights(weights, msg.version)
            except (RLCLIError, OSError, ValueError, RuntimeError) as e:  # RuntimeError: a collective op failed
                log.warning("could not load policy v%d (still serving v%d): %s", msg.version, self.engine.version, e)
                self.server.reply(identity, ErrorReply(request_id=msg.request_id, message=str(e)))
                return
            dt = self.last_load_s = time.monotonic() - t0
            self.registration.update(version=msg.version)
            log.info("loaded policy v%d in %.2fs (%d sequences kept running)", msg.version, dt,
                     self.engine.stats()["num_running"])
            self.server.reply(identity, WeightsLoaded(request_id=msg.request_id, version=msg.version,
                                                      load_time_s=dt))
        elif isinstance(msg, AbortRequests):
            ids = list(msg.request_ids)
            if msg.prefix:
                ids += [r for r in self.clients if r.startswith(msg.prefix)
                        and not (msg.except_prefix and r.startswith(msg.except_prefix))]
                if len(ids) > len(msg.request_ids):
                    log.info("aborted %d request(s) of a previous client %s*", len(ids) - len(msg.request_ids),
                             msg.prefix)
            for request_id in ids:
                self.engine.abort(request_id)
                self.clients.pop(request_id, None)
        elif isinstance(msg, HealthRequest):
            reply = self.health(msg.request_id)
            reply.unknown = [r for r in msg.request_ids if r not in self.clients]
            self.server.reply(identity, reply)
        elif isinstance(msg, Shutdown):
            self.server.reply(identity, self.health(msg.request_id))
            self.stopping = True
        else:
            self.server.reply(identity, ErrorReply(request_id=getattr(msg, "request_id", ""),
                                                   message=f"rl-infer does not handle {type(msg).__name__}"))

    def handle_http(self, command: tuple) -> None:
        """A command from the HTTP thread: ("add", GenerateRequest, sink) or ("abort", request_id)."""
        if command[0] == "add":
            _, req, sink = command
            try:
                self.engine.add_request(req, stream=True)
                self.sinks[req.request_id] = sink
            except ValueError as e:
                sink(e)
        else:
            if self.sinks.pop(command[1], None) is not None:
                self.engine.abort(command[1])

    def health(self, request_id: str) -> HealthResponse:
        stats = self.engine.stats()
        return HealthResponse(request_id=request_id, role="infer", version=self.engine.version,
                              infer_role=self.cfg.infer.role,
                              num_running=int(stats["num_running"]), num_waiting=int(stats["num_waiting"]),
                              stats=stats)

    def drain(self) -> None:
        """Handle every request already waiting on either door, without blocking."""
        item = self.server.recv(0)
        while item is not None:
            try:
                self.handle(*item)
            except Exception as e:  # a bad request must not take the server down
                log.exception("failed to handle %s", type(item[1]).__name__)
                self.server.reply(item[0], ErrorReply(request_id=getattr(item[1], "request_id", ""),
                                                      message=f"{type(e).__name__}: {e}"))
            item = self.server.recv(0)
        if self.http is not None:
            for command in self.http.take_commands():
                try:
                    self.handle_http(command)
                except Exception as e:
                    log.exception("failed to handle an HTTP request")
                    if command[0] == "add":
                        command[2](e)

    def route(self, outputs: list[GenerateResponse | Delta]) -> None:
        for out in outputs:
            rid = out.request_id
            if isinstance(out, Delta):
                if rid in self.sinks:
                    self.sinks[rid](out)
            elif (sink := self.sinks.pop(rid, None)) is not None:
                sink(out)
            elif (identity := self.clients.pop(rid, None)) is not None:
                self.server.reply(identity, out)

    def record_metrics(self) -> None:
        """One record of the interval that ends now, if the engine stepped in it (RUN/metrics/infer-<id>.jsonl)."""
        stats = self.engine.stats()
        d, dt = self.interval.take({k: v for k, v in stats.items()
                                    if (k.startswith("num_") and k not in GAUGES) or k == "step_s"})
        if not d.get("num_steps"):
            return
        kv = stats.get("kv_cache_usage")
        if kv is None and stats.get("kv_blocks_total"):
            kv = 1 - stats["kv_blocks_free"] / stats["kv_blocks_total"]
        self.run.append_metrics(f"infer-{self.instance}", {
            "step": self.interval.index, "time": time.time(), "interval_s": dt, "version": self.engine.version,
            "gen_tokens_per_s": d.get("num_generated_tokens", 0.0) / dt,
            "prompt_tokens_per_s": d.get("num_prompt_tokens", 0.0) / dt,
            "prefix_hit_rate": ratio(d.get("num_cached_tokens", 0.0), d.get("num_prompt_tokens", 0.0)),
            "requests": d.get("num_requests", 0.0), "aborted": d.get("num_aborted", 0.0),
            "preemptions": d.get("num_preemptions", 0.0), "steps": d["num_steps"],
            "step_ms": ratio(1e3 * d["step_s"], d["num_steps"]) if "step_s" in d else None,
            "num_running": stats["num_running"], "num_waiting": stats["num_waiting"], "kv_usage": kv})

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server.sock, zmq.POLLIN)
        if self.http is not None:
            poller.register(self.http.wake_socket, zmq.POLLIN)
        while not self.stopping:
            self.registration.beat()  # liveness comes from this loop: a wedged engine stops beating
            if not self.engine.has_work():
                if self.cores is not None:
                    self.cores.busy(False)
                poller.poll(50)
                if isinstance(self.engine, SharedKVMixin):
                    self.engine.publish_pending()  # what finished sequences left for the store
            self.drain()
            if self.engine.has_work():
                if self.cores is not None:
                    self.cores.busy(True)  # and take this step's share of the cores
                self.route(self.engine.step())
            if self.interval.due():
                self.record_metrics()

    def close(self) -> None:
        for sink in self.sinks.values():
            sink(RuntimeError("rl-infer is shutting down"))
        self.sinks.clear()
        if self.http is not None:
            self.http.close()
        self.registration.close()
        self.server.close()
        self.engine.close()
        if self.cores is not None:
            self.cores.close()


GAUGES = ("num_running", "num_waiting")  # engine stats named num_* that are not counters


def run(cfg: RecipeConfig, run: RunDir, instance: int = 0) -> int:
    server = InferServer(cfg, run, instance)
    stop_on_signals(lambda: setattr(server, "stopping", True))
    try:
        server.serve()
    finally:
        stats = server.engine.stats()
        server.close()
        steps = int(stats.get("num_steps", 0))
        timing = f" in {steps} engine steps ({1e3 * stats.get('step_s', 0.0) / steps:.2f} ms a step)" if steps else ""
        log.info("stopped after %d generated tokens%s", stats.get("num_generated_tokens", 0), timing)
    return 0
