"""rl-infer's serving loop: one thread, ZeroMQ between engine steps.

The loop blocks on the socket only when the engine is idle; otherwise it drains the
socket without waiting, then runs one engine step. A ``LoadWeights`` is therefore
applied between two decode steps: running sequences keep their KV and continue under
the new weights. Every reply goes to the client identity that sent the request.
"""

import time

import torch

from rlcli.config import RecipeConfig
from rlcli.errors import RLCLIError
from rlcli.infer.engine import NativeEngine
from rlcli.logging import setup_logging
from rlcli.models import DTYPES, load_model
from rlcli.models.tokenizer import load_tokenizer
from rlcli.process import stop_on_signals
from rlcli.protocol import (
    AbortRequests, ErrorReply, GenerateRequest, HealthRequest, HealthResponse, LoadWeights, Shutdown, WeightsLoaded,
)
from rlcli.transport.registry import Registration
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcServer

log = setup_logging("rl-infer")


def wait_for_policy(run: RunDir, poll_s: float = 0.2) -> int:
    """The newest complete policy version in RUN/weights, waiting for the trainer's first one."""
    announced = False
    while (step := run.latest_stable("weights")) is None:
        if not announced:
            log.info("waiting for %s (rl-train writes the initial policy)", run.weights_dir(0))
            announced = True
        time.sleep(poll_s)
    return step


class InferServer:
    def __init__(self, cfg: RecipeConfig, run: RunDir, instance: int):
        self.cfg, self.run, self.instance = cfg, run, instance
        icfg = cfg.infer
        if icfg.num_threads:
            torch.set_num_threads(icfg.num_threads)
        version = wait_for_policy(run)
        weights = run.resolve_weights(version)
        t0 = time.monotonic()
        model = load_model(weights, dtype=DTYPES[cfg.model.dtype], seed=cfg.seed)
        tokenizer = load_tokenizer(weights)
        eos = sorted(set(tokenizer.eos_token_ids) | set(model.args.eos_token_id))
        self.engine = NativeEngine(
            model, eos_token_ids=eos, max_model_len=cfg.model.max_seq_len, block_size=icfg.block_size,
            kv_cache_memory_mb=icfg.kv_cache_memory_mb, max_num_seqs=icfg.max_num_seqs,
            max_num_batched_tokens=icfg.max_num_batched_tokens, enable_prefix_caching=icfg.enable_prefix_caching,
            version=version, seed=cfg.seed * 1000 + instance)
        self.server = RpcServer(icfg.host, icfg.port)
        self.registration = Registration(run.registry_dir(), "infer", instance, {"rpc": self.server.endpoint},
                                         {"version": version})
        self.clients: dict[str, bytes] = {}  # request_id -> client identity
        self.stopping = False
        log.info("serving policy v%d from %s on %s (%d KV blocks, loaded in %.1fs)", version, weights,
                 self.server.endpoint, self.engine.blocks.num_blocks, time.monotonic() - t0)

    def handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, GenerateRequest):
            try:
                self.engine.add_request(msg)
                self.clients[msg.request_id] = identity
            except ValueError as e:
                self.server.reply(identity, ErrorReply(request_id=msg.request_id, message=str(e)))
        elif isinstance(msg, LoadWeights):
            t0 = time.monotonic()
            try:
                self.engine.load_weights(msg.weights, msg.version)
            except (RLCLIError, OSError, ValueError) as e:
                self.server.reply(identity, ErrorReply(request_id=msg.request_id, message=str(e)))
                return
            dt = time.monotonic() - t0
            self.registration.update(version=msg.version)
            log.info("loaded policy v%d in %.2fs (%d sequences kept running)", msg.version, dt,
                     len(self.engine.running))
            self.server.reply(identity, WeightsLoaded(request_id=msg.request_id, version=msg.version,
                                                      load_time_s=dt))
        elif isinstance(msg, AbortRequests):
            for request_id in msg.request_ids:
                self.engine.abort(request_id)
                self.clients.pop(request_id, None)
        elif isinstance(msg, HealthRequest):
            self.server.reply(identity, self.health(msg.request_id))
        elif isinstance(msg, Shutdown):
            self.server.reply(identity, self.health(msg.request_id))
            self.stopping = True
        else:
            self.server.reply(identity, ErrorReply(request_id=getattr(msg, "request_id", ""),
                                                   message=f"rl-infer does not handle {type(msg).__name__}"))

    def health(self, request_id: str) -> HealthResponse:
        e = self.engine
        return HealthResponse(request_id=request_id, role="infer", version=e.version, num_running=len(e.running),
                              num_waiting=len(e.waiting), stats=e.server_stats())

    def serve(self) -> None:
        while not self.stopping:
            item = self.server.recv(0 if self.engine.has_work() else 50)
            while item is not None:
                try:
                    self.handle(*item)
                except Exception as e:  # a bad request must not take the server down
                    log.exception("failed to handle %s", type(item[1]).__name__)
                    self.server.reply(item[0], ErrorReply(request_id=getattr(item[1], "request_id", ""),
                                                          message=f"{type(e).__name__}: {e}"))
                item = self.server.recv(0)
            if self.engine.has_work():
                for response in self.engine.step():
                    identity = self.clients.pop(response.request_id, None)
                    if identity is not None:
                        self.server.reply(identity, response)

    def close(self) -> None:
        self.registration.close()
        self.server.close()


def run(cfg: RecipeConfig, run: RunDir, instance: int = 0) -> int:
    server = InferServer(cfg, run, instance)
    stop_on_signals(lambda: setattr(server, "stopping", True))
    try:
        server.serve()
    finally:
        server.close()
        log.info("stopped after %d generated tokens", server.engine.stats["num_generated_tokens"])
    return 0
