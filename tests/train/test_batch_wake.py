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


def test_a_long_wait_for_a_batch_is_said_once_naming_what_is_missing(setup, caplog):
    """rl-train is otherwise silent while it waits: past WAIT_NOTE_S (0 here) it says which batch it
    waits for, and whether any rl-orchestrate is registered to write it; once per step while none is,
    once per process while one is."""
    import logging

    from rlcli.train import trainer as trainer_module
    from rlcli.train.trainer import WaitNote

    cfg, run = setup
    trainer = Trainer(cfg, run)
    trainer_module.log.addHandler(caplog.handler)  # setup_logging's basicConfig may have replaced pytest's
    caplog.set_level(logging.INFO)
    pub = Publisher("127.0.0.1", 0)
    registration = None
    try:
        trainer._wait_note = WaitNote(0.0)

        def wait(step: int) -> list[str]:
            caplog.clear()
            trainer._wait_note.start(step)
            for _ in range(2):
                trainer._next_scan = 0.0
                trainer._sleep(0.01)
            records = dict.fromkeys(caplog.records)  # a record that reached the handler twice counts once
            return [r.getMessage() for r in records if "waiting" in r.getMessage()]

        lines = wait(1)
        assert len(lines) == 1 and "step 1's batch" in lines[0] and "step_1" in lines[0], lines
        assert "no rl-orchestrate is registered" in lines[0]
        registration = Registration(run.registry_dir(), "orchestrate", 0, {"pub": pub.endpoint})
        lines = wait(2)
        assert len(lines) == 1 and "registered but has not written it" in lines[0], lines
        assert wait(2) == []  # the same step again: said already
        assert wait(3) == []  # an orchestrator is generating: long steps are normal, said once per process
        registration.close()
        registration = None
        assert "no rl-orchestrate is registered" in wait(4)[0]
    finally:
        trainer_module.log.removeHandler(caplog.handler)
        if registration is not None:
            registration.close()
        pub.close()
        trainer.close()
