"""The trainer's wait for its batch wakes on rl-orchestrate's BatchWritten announcement instead of
sleeping out its poll interval (the STABLE marker stays the truth: a missed message costs one poll)."""

import threading
import time

import pytest

from rlcli.protocol import BatchWritten
from rlcli.train.trainer import Trainer
from rlcli.transport.registry import Registration
from rlcli.transport.zmq import Publisher
from test_resume import setup  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(300)


def test_the_wait_for_a_batch_wakes_on_the_orchestrators_announcement(setup):
    cfg, run = setup
    trainer = Trainer(cfg, run)
    pub = Publisher("127.0.0.1", 0)
    registration = Registration(run.registry_dir(), "orchestrate", 0, {"pub": pub.endpoint})
    woke = threading.Event()
    sleeper = threading.Thread(target=lambda: (trainer._sleep(600.0), woke.set()), daemon=True)
    try:
        sleeper.start()
        deadline = time.monotonic() + 60
        while not woke.wait(0.05) and time.monotonic() < deadline:
            pub.publish(BatchWritten(step=1))  # again until the subscription is up (ZeroMQ's slow joiner)
        assert woke.is_set(), "a 600 s wait for a batch was not woken by BatchWritten"
    finally:
        registration.close()
        pub.close()
        trainer.close()
