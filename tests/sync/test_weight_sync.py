"""Weight updates as real processes: a publishing stand-in for rl-train (the real
WeightPublisher), real rl-sync and two real rl-infer servers, per transport.

Bit-identical delivery is checked through the servers' own output: greedy logprobs of
both servers must equal, bit for bit, those of an in-process engine holding the
trainer's weights for that version."""

import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from procs import Procs, wait_until, write_recipe
from rlcli.infer.engine import NativeEngine
from rlcli.models import load_model
from rlcli.protocol import GenerateRequest, GenerateResponse, SamplingParams
from rlcli.sync.status import read_status
from rlcli.transport.registry import list_entries
from rlcli.train.loss import token_logprobs
from rlcli.transport.zmq import RpcClient, new_request_id

pytestmark = pytest.mark.timeout(400)
DRIVER = Path(__file__).with_name("publish_driver.py")
PROMPT = [5, 17, 33, 80, 101, 7]


class Driver:
    """The publishing stand-in (tests/sync/publish_driver.py), ended by pid."""

    def __init__(self, recipe: Path, log: Path):
        self.proc = subprocess.Popen([sys.executable, str(DRIVER), str(recipe)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
                                     start_new_session=True)

    def publish(self, step: int, wait: bool = True) -> None:
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()
        if wait:
            self.published(step)

    def published(self, step: int, timeout: float = 120) -> None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"driver did not publish {step}"
        assert self.proc.stdout.readline().strip() == f"published {step}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def served(run_dir: Path) -> dict[str, int]:
    return {e.key: int(e.info.get("version", -1)) for e in list_entries(run_dir / "registry", "infer")}


def policy(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "progress" / "sync.json").read_text()).get("version", -1)
    except (FileNotFoundError, json.JSONDecodeError):
        return -1


def greedy(client: RpcClient) -> list[float]:
    return greedy_completion(client).logprobs


def greedy_completion(client: RpcClient):
    # A salt of its own: the prompt's KV is computed for this request alone, as in the reference,
    # not reused from blocks the traffic's batches computed (other batch shapes round differently).
    req = GenerateRequest(request_id=new_request_id(), prompt_ids=PROMPT, cache_salt=new_request_id(),
                          sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    reply = client.call(req, timeout_s=60)
    assert isinstance(reply, GenerateResponse), reply
    return reply.completions[0]


def reference(model_dir: Path, version: int) -> list[float]:
    torch.set_num_threads(1)
    engine = NativeEngine(load_model(model_dir, seed=1000 + version), eos_token_ids=[257], max_model_len=48,
                          kv_cache_memory_mb=4)
    engine.add_request(GenerateRequest(request_id="ref", prompt_ids=PROMPT,
                                       sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    while not (out := engine.step()):
        pass
    return out[0].completions[0].logprobs


def reference_of(model_dir: Path, version: int, tokens: list[int]) -> list[float]:
    """The logprobs of ``tokens`` after the prompt under v``version``, one full forward (teacher-forced)."""
    torch.set_num_threads(1)
    model = load_model(model_dir, seed=1000 + version)
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        lp, _ = token_logprobs(model(ids).float(), ids, 1.0)
    return lp[0, len(PROMPT):].tolist()


class Traffic:
    """Keeps requests in flight on every server until stopped; counts sent and answered."""

    def __init__(self, endpoints: list[str]):
        self.clients = [RpcClient(e) for e in endpoints]
        self.sent, self.replies = 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            for c in self.clients:
                req = GenerateRequest(request_id=new_request_id(), prompt_ids=PROMPT,
                                      sampling=SamplingParams(max_tokens=24, ignore_eos=True, seed=self.sent))
                assert c.send(req, timeout_s=30), "server unreachable"
                self.sent += 1
            for c in self.clients:
                self.replies.append(c.recv(60_000))

    def finish(self) -> list:
        self.stop.set()
        self.thread.join()
        for c in self.clients:
            c.close()
        return self.replies


def start(tmp_path, tiny_model_dir, backend: dict, ack_timeout_s: float = 4.0):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.toml", tiny_model_dir, run_dir,
                          sync={"backend": backend, "ack_timeout_s": ack_timeout_s, "poll_interval_s": 0.2})
    procs = Procs(tmp_path / "logs")
    driver = Driver(recipe, tmp_path / "logs" / "driver.log")
    return run_dir, recipe, procs, driver


def check_bit_identical(run_dir, tiny_model_dir, version: int, atol: float = 0.0) -> None:
    """Every server's greedy logprobs equal the trainer's v``version`` (bit for bit by default)."""
    expected = None if atol else reference(tiny_model_dir, version)
    for e in list_entries(run_dir / "registry", "infer"):
        client = RpcClient(e.endpoints["rpc"])
        try:
            if atol:  # teacher-forced on the server's own tokens: a near-tie may flip a greedy token
                done = greedy_completion(client)
                got, expected = done.logprobs, reference_of(tiny_model_dir, version, done.token_ids)
                assert max(abs(a - b) for a, b in zip(got, expected)) <= atol, \
                    f"{e.key} does not serve the trainer's v{version}: {got} != {expected}"
                continue
            assert greedy(client) == expected, f"{e.key} does not serve the trainer's v{version} bit for bit"
        finally:
            client.close()


def test_collective_updates_survive_generation_kill_and_stuck_server(tmp_path, tiny_model_dir, monkeypatch):
    # Collective ops get ack_timeout_s / 2 each; on a loaded 2-core machine a group's first
    # rendezvous alone can take seconds, so the deadline must leave room (a stuck server costs it
    # once). The liveness window is widened past it so that the skip, not the registry, drops the
    # stuck server (tests/test_liveness.py covers that path).
    monkeypatch.setenv("RLCLI_STALE_AFTER_S", "120")
    run_dir, recipe, procs, driver = start(tmp_path, tiny_model_dir, {"kind": "collective", "bucket_bytes": 4096},
                                           ack_timeout_s=20.0)
    try:
        driver.publish(0)
        for i in range(2):
            procs.start(f"infer-{i}", recipe, "--id", str(i))
        procs.start("sync", recipe)
        wait_until(lambda: len(served(run_dir)) == 2, 120, "two servers", procs)

        # Updates while both servers generate: no request is dropped.
        traffic = Traffic([e.endpoints["rpc"] for e in list_entries(run_dir / "registry", "infer")])
        for v in (1, 2):
            driver.publish(v)
            wait_until(lambda: policy(run_dir) == v, 120, f"PolicyUpdated({v})", procs)
        replies = traffic.finish()
        assert len(replies) == traffic.sent and all(isinstance(r, GenerateResponse) for r in replies), replies[-3:]
        versions = [v for r in replies for v in r.completions[0].versions]
        assert {0, 2} <= set(versions) or {1, 2} <= set(versions), set(versions)
        wait_until(lambda: set(served(run_dir).values()) == {2}, 120, "every server on v2", procs)  # not skipped
        check_bit_identical(run_dir, tiny_model_dir, 2)

        # A server killed during an update restarts (loads v0 from disk) and is brought to the latest.
        driver.publish(3, wait=False)
        procs.kill("infer-1")
        driver.published(3)
        procs.start("infer-1", recipe, "--id", "1")
        wait_until(lambda: served(run_dir) == {"infer-0": 3, "infer-1": 3}, 120, "both servers at v3", procs)

        # A stuck server is skipped: the policy moves on without it; it is re-admitted after SIGCONT.
        os.killpg(procs.procs["infer-0"].pid, signal.SIGSTOP)
        try:
            driver.publish(4)
            wait_until(lambda: policy(run_dir) == 4, 180, "PolicyUpdated(4) without the stuck server", procs)
            status = read_status(run_dir)
            assert status["servers"]["infer-0"]["state"] == "skipped", status
            assert status["servers"]["infer-1"]["version"] == 4
            # The trainer's send time joins the breakdown once its report is in (it may follow the acks).
            wait_until(lambda: {"gather_s", "send_s", "load_s"} <= set(read_status(run_dir)["last_update"]), 120,
                       "the update's timing breakdown", procs)
        finally:
            os.killpg(procs.procs["infer-0"].pid, signal.SIGCONT)
        wait_until(lambda: served(run_dir).get("infer-0") == 4, 120, "infer-0 back at v4", procs)
        check_bit_identical(run_dir, tiny_model_dir, 4)
    finally:
        driver.stop()
        procs.stop_all()


def test_async_filesystem_updates_skip_a_stuck_server(tmp_path, tiny_model_dir):
    run_dir, recipe, procs, driver = start(tmp_path, tiny_model_dir, {"kind": "async_filesystem"})
    try:
        driver.publish(0)
        for i in range(2):
            procs.start(f"infer-{i}", recipe, "--id", str(i))
        procs.start("sync", recipe)
        wait_until(lambda: len(served(run_dir)) == 2, 120, "two servers", procs)
        traffic = Traffic([e.endpoints["rpc"] for e in list_entries(run_dir / "registry", "infer")])
        driver.publish(1)
        wait_until(lambda: policy(run_dir) == 1, 120, "PolicyUpdated(1)", procs)
        replies = traffic.finish()
        assert len(replies) == traffic.sent and all(isinstance(r, GenerateResponse) for r in replies)
        # PolicyUpdated(1) does not mean every server has v1: one that has not acked within this test's
        # 4 s ack_timeout_s is skipped (under a full suite's load a load can take longer), and a check
        # sent then meets it mid-load (seen: logprobs 9e-6 off at the first token, 0.024 by the 6th).
        wait_until(lambda: set(served(run_dir).values()) == {1}, 120, "every server on v1", procs)
        # Files: their bytes are checked against the manifest's checksums on load. The check rescores
        # the server's own greedy tokens (a near-tie may take other tokens than the reference's greedy
        # path); another version is O(1) off, so 1e-4 tells them apart.
        check_bit_identical(run_dir, tiny_model_dir, 1, atol=1e-4)

        os.killpg(procs.procs["infer-1"].pid, signal.SIGSTOP)
        try:
            driver.publish(2)
            wait_until(lambda: policy(run_dir) == 2, 60, "PolicyUpdated(2) without the stuck server", procs)
            assert served(run_dir).get("infer-1") != 2
        finally:
            os.killpg(procs.procs["infer-1"].pid, signal.SIGCONT)
        wait_until(lambda: set(served(run_dir).values()) == {2}, 60, "infer-1 catches up", procs)
        check_bit_identical(run_dir, tiny_model_dir, 2, atol=1e-4)
    finally:
        driver.stop()
        procs.stop_all()


def test_round_ranks_count_every_receiver_of_a_server():
    """A vLLM server with tensor-parallel workers is several members of a collective round: its workers take
    consecutive ranks from the server's first, and the group's world size counts them all."""
    from rlcli.sync.rounds import member_ranks

    assert member_ranks([("infer-0", 1), ("infer-1", 4), ("infer-2", 2)]) == ({"infer-0": 1, "infer-1": 2,
                                                                                "infer-2": 6}, 8)
    assert member_ranks([]) == ({}, 1)


def test_the_default_transport_writes_off_the_trainers_step(tmp_path):
    """sync.backend defaults to async_filesystem: the trainer's publisher writes from a background thread."""
    from rlcli.config import load_recipe
    from rlcli.train.publish import make_publisher

    cfg = load_recipe(None, {})
    assert type(cfg.sync.backend).__struct_config__.tag == "async_filesystem"
    publisher = make_publisher(cfg, tmp_path, lambda *a: None, torch.device("cpu"))
    assert publisher.background
    publisher.close()
