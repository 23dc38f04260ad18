"""rl-infer never serves damaged weights: at start it takes the newest intact version, and a
LoadWeights of a damaged directory is refused with an error reply (the server keeps serving):
a resized file, a corrupt config, and one flipped byte in a shard or in the STABLE marker."""

import shutil
import threading

import pytest

from integrity import flip_byte, flip_marker_step
from procs import serve_initial_policy, write_recipe
from rlcli.config import load_recipe
from rlcli.infer.server import InferServer
from rlcli.protocol import ErrorReply, FsWeights, HealthRequest, HealthResponse, LoadWeights, WeightsLoaded
from rlcli.transport import atomic
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
        assert isinstance(reply, ErrorReply) and "config.json does not match its xxh3_64" in reply.message, reply
        reply = client.call(HealthRequest(request_id="h"), timeout_s=30)
        assert isinstance(reply, HealthResponse) and reply.version == 0
    finally:
        client.close()
        server.stopping = True
        loop.join()
        server.close()


def _copy_policy(run: RunDir, step: int) -> None:
    with atomic_dir(run.weights_dir(step), {"step": step}) as tmp:
        for f in run.weights_dir(0).iterdir():
            if f.name != "STABLE":
                shutil.copy(f, tmp / f.name)


@pytest.mark.parametrize("damage", ["shard", "marker"])
def test_a_flipped_byte_in_a_shard_or_marker_is_refused(tmp_path, tiny_model_dir, damage, monkeypatch):
    """One byte of v1's safetensors shard (a weight value: the size and header stay right) or
    of its STABLE marker is changed: the start takes v0, a LoadWeights of v1 is refused
    naming the file, and an intact v2 then loads. The shard counts as large here, so only the
    reader's hash of the mapping it copies from can see the flip."""
    monkeypatch.setattr(atomic, "SMALL_FILE_BYTES", 0)
    run_dir = tmp_path / "run"
    cfg = load_recipe(write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir))
    serve_initial_policy(run_dir, tiny_model_dir)
    run = RunDir(run_dir)
    _copy_policy(run, 1)
    if damage == "shard":
        flip_byte(run.weights_dir(1) / "model.safetensors")
    else:
        flip_marker_step(run.weights_dir(1))
    server = InferServer(cfg, run, 0)
    loop = threading.Thread(target=server.serve)
    loop.start()
    client = RpcClient(server.server.endpoint)
    try:
        assert server.engine.version == 0, "the start served the corrupt v1"
        reply = client.call(LoadWeights(request_id="r", version=1, weights=FsWeights(path=str(run.weights_dir(1)))),
                            timeout_s=30)
        assert isinstance(reply, ErrorReply), reply
        named = "model.safetensors is corrupt" if damage == "shard" else "STABLE is corrupt"
        assert named in reply.message and "\n" not in reply.message, reply.message
        _copy_policy(run, 2)
        reply = client.call(LoadWeights(request_id="r2", version=2, weights=FsWeights(path=str(run.weights_dir(2)))),
                            timeout_s=30)
        assert isinstance(reply, WeightsLoaded), reply
    finally:
        client.close()
        server.stopping = True
        loop.join()
        server.close()
