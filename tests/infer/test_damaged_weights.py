"""rl-infer never serves damaged weights: at start it takes the newest intact version, and a
LoadWeights of a damaged directory is refused with an error reply (the server keeps serving)."""

import shutil
import threading

import pytest

from procs import serve_initial_policy, write_recipe
from rlcli.config import load_recipe
from rlcli.infer.server import InferServer
from rlcli.protocol import ErrorReply, FsWeights, HealthRequest, HealthResponse, LoadWeights
from rlcli.transport.atomic import atomic_dir
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcClient

pytestmark = pytest.mark.timeout(120)


def test_damaged_weights_are_never_served(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir))
    serve_initial_policy(run_dir, tiny_model_dir)
    run = RunDir(run_dir)
    with atomic_dir(run.weights_dir(1), {"step": 1}) as tmp:
        for f in run.weights_dir(0).iterdir():
            if f.name != "STABLE":
                shutil.copy(f, tmp / f.name)
    config = run.weights_dir(1) / "config.json"
    config.write_text(config.read_text().replace('"', "'", 1))  # same size, other bytes
    server = InferServer(cfg, run, 0)
    loop = threading.Thread(target=server.serve)
    loop.start()
    client = RpcClient(server.server.endpoint)
    try:
        assert server.engine.version == 0  # v1 is damaged: the start took v0
        reply = client.call(LoadWeights(request_id="r", version=1, weights=FsWeights(path=str(run.weights_dir(1)))),
                            timeout_s=30)
        assert isinstance(reply, ErrorReply) and "config.json does not match its sha256" in reply.message, reply
        reply = client.call(HealthRequest(request_id="h"), timeout_s=30)
        assert isinstance(reply, HealthResponse) and reply.version == 0
    finally:
        client.close()
        server.stopping = True
        loop.join()
        server.close()
