"""RUN/sync/status.json (rlcli.sync.status) is rewritten whenever what it shows changes, also
when rl-sync completes the last update's timing in place: the trainer's report of a collective
send can come after the update was announced."""

from types import SimpleNamespace

from rlcli.sync.status import read_status, write_status


def test_the_last_update_completed_in_place_is_written(tmp_path):
    run = SimpleNamespace(root=tmp_path)
    server = SimpleNamespace(version=4, entry=SimpleNamespace(host="h", pid=1), skipped=False, pending=None,
                             last_error="", failures=0)
    last_update = {"version": 4, "gather_s": 0.001, "load_s": 0.01}
    write_status(run, "collective", 4, 4, {"infer-0": server}, last_update)
    assert "send_s" not in read_status(tmp_path)["last_update"]
    last_update.update(group_s=0.004, send_s=0.011)  # what Rounds._finish does once the trainer reported
    write_status(run, "collective", 4, 4, {"infer-0": server}, last_update)
    assert read_status(tmp_path)["last_update"]["send_s"] == 0.011
