import json
import os
import subprocess
import sys

import pytest

from integrity import flip_byte, flip_marker_step
from rlcli.errors import RunDirError
from rlcli.transport.atomic import (
    SMALL_FILE_BYTES, atomic_dir, atomic_write_json, checksums_of, clean_temporaries, is_stable, read_json,
    read_marker, remove_dir, verify_dir, verify_files,
)
from rlcli.transport.rundir import RunDir


def test_atomic_dir_marks_only_complete_directories(tmp_path):
    final = tmp_path / "weights" / "step_1"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "a.bin").write_bytes(b"half")
            raise RuntimeError("crash while writing")
    assert not final.exists() and not is_stable(final)
    assert list((tmp_path / "weights").iterdir()) == []  # the temporary is gone too
    with atomic_dir(final, {"step": 1}) as tmp:
        (tmp / "a.bin").write_bytes(b"whole")
    assert is_stable(final) and read_marker(final)["step"] == 1
    assert (final / "a.bin").read_bytes() == b"whole"


def test_atomic_dir_replaces_an_existing_directory(tmp_path):
    final = tmp_path / "step_3"
    with atomic_dir(final) as tmp:
        (tmp / "old").write_text("1")
    with atomic_dir(final) as tmp:
        (tmp / "new").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["STABLE", "new"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_3"]


def test_remove_dir_unmarks_first(tmp_path):
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "x").write_text("1")
    remove_dir(tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_clean_temporaries_keeps_those_of_live_writers(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f".step_1.tmp-{dead}").mkdir()
    (tmp_path / f".step_2.tmp-{os.getppid()}").mkdir()  # our parent is alive
    (tmp_path / "step_0").mkdir()
    clean_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".step_2.tmp-{os.getppid()}", "step_0"]


def test_atomic_json(tmp_path):
    atomic_write_json(tmp_path / "p.json", {"a": 1})
    assert read_json(tmp_path / "p.json") == {"a": 1}
    assert read_json(tmp_path / "missing.json", "default") == "default"
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_run_dir_claim_waits_for_a_creator_between_create_and_write(tmp_path):
    """Processes of one run start together: one creates run.json, the others read it; where it is
    created in place (no hard links: O_EXCL, empty for a moment), an empty file is waited for, not a
    JSONDecodeError."""
    import threading

    first = RunDir(tmp_path / "run")
    first.claim("reverse", {"model": {"path": "/m"}})
    content = (tmp_path / "run" / "run.json").read_text()
    (tmp_path / "run" / "run.json").write_text("")  # the creator's state right after its O_EXCL open
    writer = threading.Timer(0.2, lambda: (tmp_path / "run" / "run.json").write_text(content))
    writer.start()
    RunDir(tmp_path / "run").claim("reverse", {"model": {"path": "/m"}})
    writer.join()


def test_run_dir_refuses_another_recipe(tmp_path):
    run = RunDir(tmp_path / "run")
    run.claim("reverse", {"model": {"path": "/m"}, "env": {"name": "reverse"}})
    run.claim("reverse", {"model": {"path": "/m"}, "env": {"name": "reverse"}})  # same recipe: fine
    with pytest.raises(RunDirError, match="belongs to recipe 'reverse'"):
        run.claim("other", {"model": {"path": "/m"}, "env": {"name": "reverse"}})
    with pytest.raises(RunDirError, match="model or environment"):
        run.claim("reverse", {"model": {"path": "/other"}, "env": {"name": "reverse"}})
    assert json.loads((tmp_path / "run" / "run.json").read_text())["name"] == "reverse"


def test_stable_steps_ignore_incomplete(tmp_path):
    run = RunDir(tmp_path)
    for step in (0, 1, 2):
        with atomic_dir(run.weights_dir(step)):
            pass
    run.weights_dir(3).mkdir()  # renamed into place but never marked
    (run.root / "weights" / ".step_4.tmp-1").mkdir()
    assert run.stable_steps("weights") == [0, 1, 2]
    assert run.latest_stable("weights") == 2 and run.latest_stable("rollouts") is None


def test_resolve_weights_follows_source_marker(tmp_path):
    run = RunDir(tmp_path)
    with atomic_dir(run.weights_dir(0), {"source": "/models/base"}):
        pass
    with atomic_dir(run.weights_dir(1)):
        pass
    assert str(run.resolve_weights(0)) == "/models/base"
    assert run.resolve_weights(1) == run.weights_dir(1)


def test_metrics_skip_a_partial_last_line_and_the_next_record_is_kept_whole(tmp_path):
    """A write cut short (a kill, a full disk) leaves a torn last line: readers skip it, and the next
    append starts a line of its own instead of gluing its record onto the fragment."""
    run = RunDir(tmp_path)
    run.append_metrics("train", {"step": 1})
    with open(run.metrics_file("train"), "a") as f:
        f.write('{"step": 2, "lo')
    assert run.read_metrics("train") == [{"step": 1}]
    run.append_metrics("train", {"step": 3})
    run.append_metrics("train", {"step": 4})
    assert run.read_metrics("train") == [{"step": 1}, {"step": 3}, {"step": 4}]


def test_run_json_is_created_whole_or_not_at_all(tmp_path, monkeypatch):
    """run.json is written under a temporary name and linked into place: a full disk leaves no
    run.json (and no temporary) to refuse the next start; without hard links, O_EXCL creates it."""
    import errno

    from rlcli.errors import StorageFull

    real_open = open

    def full_disk(file, mode="r", *args, **kwargs):
        if ".run.json.tmp-" in str(file):
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk)
    with pytest.raises(StorageFull):
        RunDir(tmp_path / "run").claim("reverse", {"model": {"path": "/m"}})
    monkeypatch.setattr("builtins.open", real_open)
    assert not [p for p in (tmp_path / "run").iterdir() if "run.json" in p.name]

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    RunDir(tmp_path / "run").claim("reverse", {"model": {"path": "/m"}})
    assert json.loads((tmp_path / "run" / "run.json").read_text())["name"] == "reverse"
    RunDir(tmp_path / "run").claim("reverse", {"model": {"path": "/m"}})  # the second creator reads it
    assert [p.name for p in (tmp_path / "run").iterdir() if "run.json" in p.name] == ["run.json"]


def test_temporaries_carry_host_and_rank_and_other_hosts_live_ones_are_left_alone(tmp_path, monkeypatch):
    from rlcli.transport import atomic

    monkeypatch.setenv("RANK", "3")
    tag = atomic.temp_tag()
    assert tag == f"{atomic._HOST}-r3-{os.getpid()}"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    mine_dead = f".step_1.tmp-{atomic._HOST}-r0-{dead}"
    other_host = f".step_2.tmp-other-node-07-r1-{dead}"  # same pid number, another host, writing now
    (tmp_path / mine_dead).mkdir()
    (tmp_path / other_host).mkdir()
    (tmp_path / other_host / "model.safetensors").write_bytes(b"x")
    (tmp_path / f".x.json.tmp-{atomic._HOST}-r2-{dead}-0123abcd").write_text("{}")
    clean_temporaries(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [other_host]


def test_another_hosts_abandoned_temporaries_go_after_they_stand_still(tmp_path, monkeypatch):
    """A dead node's half-written directory (a Slurm requeue put the job elsewhere): kept while any
    file in it changed within STALE_TEMP_S, removed after; a file's change counts, not the folder's."""
    from rlcli.transport import atomic

    clock = [1e9]
    monkeypatch.setattr(atomic.time, "time", lambda: clock[0])
    stuck = tmp_path / ".step_3.tmp-dead-node-r0-4242"
    stuck.mkdir()
    (stuck / "shard-0.safetensors").write_bytes(b"half")
    (tmp_path / ".STATE.json.tmp-dead-node-r0-4242-0123abcd").write_text("{")
    changed = max(p.stat().st_mtime for p in [stuck, *stuck.iterdir()])
    clock[0] = changed + atomic.STALE_TEMP_S - 5
    clean_temporaries(tmp_path)
    assert stuck.exists()
    os.utime(stuck, (changed - 1e4, changed - 1e4))  # the folder old, its file still recent
    clean_temporaries(tmp_path)
    assert stuck.exists()
    clock[0] = changed + atomic.STALE_TEMP_S + 5
    clean_temporaries(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_another_hosts_interrupted_replace_is_moved_back_after_the_grace(tmp_path, monkeypatch):
    """The fallback replace (NFS, Lustre) died on another node between its two renames: the complete
    old directory comes back under its name once REPLACE_GRACE_S has passed, not before."""
    from rlcli.transport import atomic

    with atomic_dir(tmp_path / "step_1", {"v": 1}) as d:
        (d / "a").write_text("old")
    old = tmp_path / ".step_1.old-dead-node-r0-4242-0123abcd"
    os.replace(tmp_path / "step_1", old)
    moved = atomic._last_change(old)
    clock = [moved + atomic.REPLACE_GRACE_S - 5]
    monkeypatch.setattr(atomic.time, "time", lambda: clock[0])
    clean_temporaries(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [old.name]
    clock[0] = moved + atomic.REPLACE_GRACE_S + 5
    clean_temporaries(tmp_path)
    assert is_stable(tmp_path / "step_1") and (tmp_path / "step_1" / "a").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]


_watch: dict = {}


def _audit(event, args):
    # Before every rename or delete made while replacing, the directory must be complete.
    if _watch and event in ("os.rename", "os.remove", "os.rmdir", "shutil.rmtree"):
        _watch["seen"] += 1
        if not is_stable(_watch["final"]):
            _watch["unmarked"].append((event, args))


sys.addaudithook(_audit)


def test_replacing_a_directory_never_leaves_it_unmarked(tmp_path):
    final = tmp_path / "step_1"
    with atomic_dir(final, {"v": 1}) as d:
        (d / "a").write_text("old")
    _watch.update(final=final, seen=0, unmarked=[])
    try:
        with atomic_dir(final, {"v": 2}) as d:
            (d / "a").write_text("new")
    finally:
        seen, unmarked = _watch["seen"], _watch["unmarked"]
        _watch.clear()
    assert seen and not unmarked, unmarked
    assert (final / "a").read_text() == "new" and read_marker(final)["v"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]


def test_a_crash_between_the_fallback_renames_restores_the_old_directory(tmp_path, monkeypatch):
    from rlcli.transport import atomic

    final = tmp_path / "step_1"
    with atomic_dir(final, {"v": 1}) as d:
        (d / "a").write_text("old")
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE
    real, calls = os.replace, []

    def crash_on_second(src, dst):
        if os.path.isdir(src):
            calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the writer dies between moving the old one aside and the new one in
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(final, {"v": 2}) as d:
            (d / "a").write_text("new")
    monkeypatch.setattr(atomic.os, "replace", real)
    assert not final.exists()
    clean_temporaries(tmp_path)  # what the next writer does first
    assert is_stable(final) and (final / "a").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]


def test_temporary_directories_of_one_writer_are_distinct(tmp_path):
    from rlcli.transport.atomic import begin_dir

    a, b = begin_dir(tmp_path / "x"), begin_dir(tmp_path / "x")
    assert a != b and a.is_dir() and b.is_dir()


def test_a_flipped_byte_in_any_file_or_the_marker_is_named(tmp_path):
    final = tmp_path / "d"
    with atomic_dir(final, {"step": 3}) as tmp:
        (tmp / "small.json").write_text('{"a": 1}')
        (tmp / "large.bin").write_bytes(bytes(range(256)) * (SMALL_FILE_BYTES // 256 + 1))
    assert verify_files(final) == [] and set(checksums_of(final)) == {"small.json", "large.bin"}
    flip_byte(final / "large.bin")
    assert verify_dir(final) == []  # a large file is checked by its reader, on the bytes it parses
    assert verify_files(final) == ["large.bin does not match its xxh3_64"]
    flip_byte(final / "large.bin")
    flip_byte(final / "small.json", 1)
    assert verify_dir(final) == ["small.json does not match its xxh3_64"]
    flip_byte(final / "small.json", 1)
    flip_marker_step(final)
    [problem] = verify_dir(final)
    assert problem.startswith(f"{final / 'STABLE'} is corrupt") and read_marker(final) is None


def test_a_pinned_version_keeps_its_marker_bytes_when_pruning_is_refused(tmp_path):
    from rlcli.transport.pins import pin, prune_weights

    final = tmp_path / "weights" / "step_1"
    with atomic_dir(final, {"step": 1}) as tmp:
        (tmp / "a").write_text("x")
    before = (final / "STABLE").read_bytes()
    pin(tmp_path, "infer-0", 1)
    assert not prune_weights(final, 1) and (final / "STABLE").read_bytes() == before and verify_dir(final) == []


def test_progress_carries_a_checksum_and_a_damaged_one_reads_as_none(tmp_path, caplog):
    """A bit flip that keeps the JSON valid (a step counter 12 -> 13) must not be believed:
    restarts then fall back to the STABLE markers."""
    run = RunDir(tmp_path)
    run.write_progress("orchestrate", step=12)
    assert run.read_progress("orchestrate")["step"] == 12
    path = run.progress_file("orchestrate")
    path.write_text(path.read_text().replace('"step": 12', '"step": 13'))
    with caplog.at_level("WARNING", logger="rlcli"):
        assert run.read_progress("orchestrate") == {}
    assert "damaged" in caplog.text
    path.write_text('{"step": 5}')  # written before checksums: taken as is
    assert run.read_progress("orchestrate") == {"step": 5}


def test_a_deleter_killed_midway_leaves_only_a_temporary_that_is_cleaned(tmp_path, monkeypatch):
    from rlcli.transport import atomic

    run = RunDir(tmp_path)
    for step in (1, 2):
        with atomic_dir(run.checkpoint_dir(step), {"step": step}) as d:
            (d / "shard").write_bytes(b"x" * 100)

    def killed(path, ignore_errors=False):
        os.unlink(os.path.join(path, "shard"))  # part of the files gone, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        remove_dir(run.checkpoint_dir(1))
    monkeypatch.undo()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "step_1" not in names and names[1] == "step_2" and names[0].startswith(".step_1.tmp-")
    assert run.stable_steps("checkpoints") == [2]
    clean_temporaries(tmp_path / "checkpoints")  # the next trainer's start (the deleter is gone)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_2"]


def test_a_pruner_killed_with_the_version_aside_has_it_put_back(tmp_path, monkeypatch):
    from rlcli.transport import pins

    final = tmp_path / "weights" / "step_1"
    with atomic_dir(final, {"step": 1}) as d:
        (d / "a").write_text("x")

    def killed(run_root):
        raise KeyboardInterrupt  # between moving step_1 aside and looking for pins

    monkeypatch.setattr(pins, "pinned_versions", killed)
    with pytest.raises(KeyboardInterrupt):
        pins.prune_weights(final, 1)
    monkeypatch.undo()
    assert not final.exists()
    clean_temporaries(tmp_path / "weights")
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["step_1"] and verify_dir(final) == []
    assert pins.prune_weights(final, 1) and list((tmp_path / "weights").iterdir()) == []


def test_retention_keeps_the_newest_and_the_milestones():
    from rlcli.transport.rundir import retired

    assert retired([0, 1, 2, 3, 4, 5, 6], 2) == [0, 1, 2, 3, 4]
    assert retired([0, 1, 2, 3, 4, 5, 6], 2, every=2) == [0, 1, 3]  # policy 0 is not a milestone
    assert retired([3, 4], 3, every=2) == []
