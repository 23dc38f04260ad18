import threading
import time

import msgspec
import pytest
import zmq

from rlcli.errors import PeerUnreachable
from rlcli.protocol import PROTOCOL_VERSION, ErrorReply, HealthRequest, HealthResponse, PolicyUpdated
from rlcli.transport.registry import Registration, describe_gone, list_entries, read_entry
from rlcli.transport.zmq import Publisher, RpcClient, RpcServer, Subscriber, context


def _serve(server: RpcServer, stop: threading.Event):
    while not stop.is_set():
        item = server.recv(20)
        if item:
            identity, msg = item
            server.reply(identity, HealthResponse(request_id=msg.request_id, role="test", version=7))


def test_request_reply_and_malformed_messages():
    server = RpcServer()
    stop = threading.Event()
    t = threading.Thread(target=_serve, args=(server, stop), daemon=True)
    t.start()
    client = RpcClient(server.endpoint)
    try:
        reply = client.call(HealthRequest(request_id="a"), timeout_s=5)
        assert isinstance(reply, HealthResponse) and reply.version == 7
        # Garbage gets an ErrorReply and the server keeps serving.
        raw = context().socket(zmq.DEALER)
        raw.connect(server.endpoint)
        raw.send(b"\x81\xa4type\xa3bad")
        raw.send(msgspec.msgpack.encode({"type": "health", "protocol": 99, "request_id": "old"}))
        assert raw.poll(5000)
        first = msgspec.msgpack.decode(raw.recv())
        assert first["type"] == "error"
        assert raw.poll(5000)
        second = msgspec.msgpack.decode(raw.recv())
        assert second["type"] == "error" and second["request_id"] == "old" and "protocol" in second["message"]
        raw.close(linger=0)
        assert isinstance(client.call(HealthRequest(request_id="b"), timeout_s=5), HealthResponse)
    finally:
        stop.set()
        t.join()
        client.close()
        server.close()


def test_unreachable_peer_fails_fast():
    client = RpcClient("tcp://127.0.0.1:9")  # nothing listens on the discard port
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable, match="cannot reach rl-infer"):
        client.call(HealthRequest(request_id="x"), timeout_s=0.5, peer="rl-infer")
    assert time.monotonic() - t0 < 5
    client.close()


def test_error_reply_is_a_message():
    assert ErrorReply(message="m").request_id == ""


def test_pub_sub():
    pub = Publisher()
    sub = Subscriber([pub.endpoint])
    got = None
    for _ in range(100):  # slow joiner: the subscription needs a moment
        pub.publish(PolicyUpdated(version=3))
        got = sub.recv(50)
        if got:
            break
    assert got == PolicyUpdated(version=3)
    pub.close()
    sub.close()


def test_registry_heartbeat_comes_from_the_work_loop(tmp_path):
    import os
    import subprocess
    import sys

    from rlcli.transport.atomic import temp_tag

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    orphan = tmp_path / f".infer-2.json.tmp-{temp_tag().rsplit('-', 1)[0]}-{dead}-0123abcd"
    orphan.write_text("{")  # left by a process killed mid-write
    assert str(os.getpid()) not in orphan.name
    reg = Registration(tmp_path, "infer", 2, {"rpc": "tcp://h:1"}, {"version": 0}, interval=0.05)
    entry = read_entry(tmp_path / "infer-2.json")
    assert entry.pid and entry.endpoints == {"rpc": "tcp://h:1"} and entry.info == {"version": 0}
    assert not orphan.exists()
    time.sleep(0.2)  # a wedged loop does not beat: nothing else may refresh the entry
    assert read_entry(tmp_path / "infer-2.json").heartbeat == entry.heartbeat
    reg.beat()
    assert read_entry(tmp_path / "infer-2.json").heartbeat > entry.heartbeat
    reg.update(version=5)
    assert [e.info["version"] for e in list_entries(tmp_path, "infer")] == [5]
    assert list_entries(tmp_path, "train") == []
    assert list_entries(tmp_path, "infer", stale_after=0.0) == []
    reg.beat(busy_s=3600)  # a long operation announced: alive past stale_after until it ends
    assert [e.key for e in list_entries(tmp_path, "infer", stale_after=0.0)] == ["infer-2"]
    reg.beat()  # the next ordinary beat ends the promise at once
    assert list_entries(tmp_path, "infer", stale_after=0.0) == []
    gone = read_entry(tmp_path / "infer-2.json")
    assert describe_gone(gone, gone).startswith(f"infer-2 (pid {gone.pid} on {gone.host}) is dead or stopped")
    reg.close()
    assert not (tmp_path / "infer-2.json").exists()


def test_a_long_operation_extends_the_promise_and_never_shortens_it(tmp_path):
    """expect_long (a kernel's first-use compile deep in a step) extends the registration that took its
    notices; a standing promise with half the window left is kept as it is (no write), and a longer one
    announced by the loop is never cut short."""
    from rlcli.transport.registry import expect_long

    reg = Registration(tmp_path, "train", 0, {})
    expect_long(60)  # nobody takes notices yet
    assert read_entry(tmp_path / "train-0.json").busy_until == 0
    reg.take_long_op_notices()
    t0 = time.time()
    expect_long(60)
    first = read_entry(tmp_path / "train-0.json")
    assert t0 + 60 <= first.busy_until <= time.time() + 60
    expect_long(60)  # 30 s or more left: the entry is not rewritten
    assert read_entry(tmp_path / "train-0.json").heartbeat == first.heartbeat
    reg.beat(busy_s=3600)  # the trainer's step promise
    expect_long(60)
    assert read_entry(tmp_path / "train-0.json").busy_until >= t0 + 3600
    reg.close()
    expect_long(7200)  # a closed registration takes no notices
    assert reg.entry.busy_until < t0 + 7200


def test_registry_updates_race_each_other(tmp_path):
    """Regression: two writers of one entry once shared a temporary file name."""
    reg = Registration(tmp_path, "infer", 0, {"rpc": "tcp://h:1"}, interval=0.0001)
    writer = threading.Thread(target=lambda: [reg.beat() for _ in range(2000)])
    writer.start()
    try:
        for v in range(2000):
            reg.update(version=v)
    finally:
        writer.join()
        reg.close()
    assert not list(tmp_path.iterdir())


def test_oversized_and_inconsistent_messages_get_error_replies():
    server = RpcServer(max_message_bytes=1 << 16)
    stop = threading.Event()
    t = threading.Thread(target=_serve, args=(server, stop), daemon=True)
    t.start()
    raw = context().socket(zmq.DEALER)
    raw.connect(server.endpoint)
    try:
        big = msgspec.msgpack.encode({"type": "cache_put", "protocol": PROTOCOL_VERSION, "request_id": "big",
                                      "keys": [b"k"], "values": [b"\0" * ((1 << 16) + 100)]})
        bad_tensor = msgspec.msgpack.encode({
            "type": "generate_response", "protocol": PROTOCOL_VERSION, "request_id": "t", "num_prompt_tokens": 1,
            "completions": [{"token_ids": [1], "logprobs": [0.0], "versions": [0], "finish_reason": "stop",
                             "routed_experts": [b"\0" * 5, "int16", [2, 2]]}]})
        for payload, needle in ((big, "exceeds this server's limit of 65536 bytes"), (bad_tensor, "needs 8 bytes, got 5")):
            raw.send(payload)
            assert raw.poll(5000)
            reply = msgspec.msgpack.decode(raw.recv())
            assert reply["type"] == "error" and needle in reply["message"], reply
        client = RpcClient(server.endpoint)
        assert isinstance(client.call(HealthRequest(request_id="ok"), timeout_s=5), HealthResponse)
        client.close()
    finally:
        raw.close(linger=0)
        stop.set()
        t.join()
        server.close()


@pytest.mark.parametrize("handled", [False, True])
def test_sigterm_before_the_service_handler_removes_the_entry(tmp_path, handled):
    """A process that registered and has not installed its service's SIGTERM handler yet (a launcher
    stopping the run while the service finishes starting) removes its entry, then dies of the signal;
    once stop_on_signals is installed, SIGTERM is the service's to handle (here: exit 0 after its close)."""
    import signal
    import subprocess
    import sys
    import time

    child = f"""
import sys, time
from rlcli.transport.registry import Registration
r = Registration({str(tmp_path)!r}, "infer", 0, {{}})
if {handled}:
    from rlcli.process import stop_on_signals
    stopping = []
    stop_on_signals(lambda: stopping.append(1))
    print("ready", flush=True)
    while not stopping:
        time.sleep(0.01)
    r.close()
    sys.exit(0)
print("ready", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert (tmp_path / "infer-0.json").exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == (0 if handled else -signal.SIGTERM)
    assert not (tmp_path / "infer-0.json").exists()


def test_one_role_and_id_is_one_process(tmp_path):
    """A second rl-infer under the same id would overwrite the first's entry at every beat, and peers
    would drop and re-add the server each time: it is refused while the first runs (its pid, on this
    host), and a dead holder's entry (even a zombie's) is taken over."""
    import os
    import subprocess
    import sys

    from rlcli.errors import RunDirError

    child = f"""
import time
from rlcli.transport.registry import Registration
r = Registration({str(tmp_path)!r}, "infer", 0, {{}})
print("ready", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(RunDirError, match=rf"infer-0 is already running .* \(pid {proc.pid} on .*\): pass "
                                              r"another --id, stop that process, or use another --run-dir"):
            Registration(tmp_path, "infer", 0, {})
        Registration(tmp_path, "infer", 1, {}).close()  # another id is another process
        proc.kill()
        while not os.path.exists(f"/proc/{proc.pid}/stat") or open(f"/proc/{proc.pid}/stat").read().split()[2] != "Z":
            time.sleep(0.01)  # killed, and a zombie until waited for: not running
        reg = Registration(tmp_path, "infer", 0, {})
        assert read_entry(tmp_path / "infer-0.json").incarnation == reg.entry.incarnation
        reg.close()
    finally:
        proc.kill()
        proc.wait()


def test_an_entry_of_another_host_is_taken_over_only_once_it_stops_beating(tmp_path):
    reg = Registration(tmp_path, "sync", 0, {})
    entry = read_entry(tmp_path / "sync-0.json")
    reg._write = lambda: None  # noqa: E731  (this registration is only the "other host's" writer below)
    entry.host = "another-host"
    beating = threading.Event()

    def other_host():
        while not beating.is_set():
            entry.heartbeat = time.time()
            (tmp_path / "sync-0.tmp").write_bytes(msgspec.json.encode(entry))
            (tmp_path / "sync-0.tmp").rename(tmp_path / "sync-0.json")
            time.sleep(0.1)

    t = threading.Thread(target=other_host)
    t.start()
    from rlcli.errors import RunDirError

    while read_entry(tmp_path / "sync-0.json").host != "another-host":
        time.sleep(0.01)
    try:
        with pytest.raises(RunDirError, match="sync-0 is already running .* on another-host"):
            Registration(tmp_path, "sync", 0, {})
    finally:
        beating.set()
        t.join()
    taken = Registration(tmp_path, "sync", 0, {})  # a fresh entry that no longer beats: dead or hung
    assert read_entry(tmp_path / "sync-0.json").incarnation == taken.entry.incarnation
    taken.close()


def test_processes_that_share_a_setting_must_agree_on_it(tmp_path):
    """A process registering later than a live peer with another value of a shared setting stops,
    naming the key; its entry is withdrawn. Settings only one of them registered are not compared."""
    from rlcli.errors import ConfigError

    train = Registration(tmp_path, "train", 0, {}, {"settings": {"num_steps": 10, "sync.backend.kind": "collective"}})
    with pytest.raises(ConfigError, match=r'sync.backend.kind = "async_filesystem" here but train-0 \(pid \d+ on '
                                          r'.*\) runs with sync.backend.kind = "collective": give every process of '
                                          r'the run the same sync.backend.kind'):
        Registration(tmp_path, "sync", 0, {}, {"settings": {"sync.backend.kind": "async_filesystem"}})
    assert not (tmp_path / "sync-0.json").exists()
    Registration(tmp_path, "sync", 0, {}, {"settings": {"sync.backend.kind": "collective"}}).close()
    orchestrate = Registration(tmp_path, "orchestrate", 0, {}, {"settings": {"num_steps": 10, "r3": True}})
    with pytest.raises(ConfigError, match="num_steps = 12 here but orchestrate-0"):  # the first peer in key order
        Registration(tmp_path, "orchestrate", 1, {}, {"settings": {"num_steps": 12}})
    orchestrate.close()
    train.close()
