"""The live view tails RUN/metrics instead of re-reading it on every redraw."""

from rlcli.orchestrate.dashboard import MetricsTail
from rlcli.transport.rundir import RunDir


def test_metrics_tail_reads_only_complete_new_records(tmp_path):
    run = RunDir(tmp_path)
    tail = MetricsTail(run, "train")
    assert tail.read_new() == []  # no file yet
    run.append_metrics("train", {"step": 1})
    with open(run.metrics_file("train"), "a") as f:
        f.write('{"step": 2')  # being written
    assert tail.read_new() == [{"step": 1}]
    with open(run.metrics_file("train"), "a") as f:
        f.write(', "loss": 0.5}\n')
    assert tail.read_new() == [{"step": 2, "loss": 0.5}]
    assert tail.read_new() == []
