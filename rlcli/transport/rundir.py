"""The run directory: the durable truth every process shares.

::

    RUN/
      run.json                      recipe identity (name + fingerprint of model and env)
      config/<command>.toml         resolved config each process ran with
      registry/<role>-<id>.json     endpoint, pid, host, heartbeat of each live process
      rollouts/step_<N>/<rank>.msgpack (+ .sha256), STABLE
      weights/step_<N>/             HF-layout safetensors + config.json, STABLE
      checkpoints/step_<N>/         trainer state for resume, STABLE
      progress/<command>.json       last completed step / policy version (+ checksum)
      sync/store.json, status.json  rl-sync's rendezvous store; servers' versions, last update timing
      metrics/<command>.jsonl       one JSON object per step
      logs/<command>-<id>.log

A process that missed a ZeroMQ announcement recovers by reading this directory.
"""

import errno
import hashlib
import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from rlcli.errors import RunDirError
from rlcli.transport.atomic import (
    atomic_write_bytes,
    clean_temporaries,
    is_stable,
    read_checked_json,
    read_marker,
    storage_full,
    temp_tag,
    verify_dir,
    write_checked_json,
)

_STEP_RE = re.compile(r"^step_(\d+)$")


def retired(steps: list[int], keep: int, every: int = 0) -> list[int]:
    """Of sorted ``steps``, those to delete: all but the newest ``keep``, sparing milestones (the
    positive multiples of ``every``; 0: none)."""
    return [s for s in steps[:-keep] if not (every and s and s % every == 0)]


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.sinks: list = []  # rlcli.transport.sinks.MetricsSink, attached by the process that logs

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    # ------------------------------------------------------------ layout
    def config_file(self, command: str) -> Path:
        return self.root / "config" / f"{command}.toml"

    def registry_dir(self) -> Path:
        return self.root / "registry"

    def rollouts_dir(self, step: int) -> Path:
        return self.root / "rollouts" / f"step_{step}"

    def weights_dir(self, step: int) -> Path:
        return self.root / "weights" / f"step_{step}"

    def checkpoint_dir(self, step: int) -> Path:
        return self.root / "checkpoints" / f"step_{step}"

    def progress_file(self, command: str) -> Path:
        return self.root / "progress" / f"{command}.json"

    def metrics_file(self, command: str) -> Path:
        return self.root / "metrics" / f"{command}.jsonl"

    def log_file(self, command: str, instance: int | str = 0) -> Path:
        return self.root / "logs" / f"{command}-{instance}.log"

    # ------------------------------------------------------------ identity
    def claim(self, name: str, identity: dict[str, Any]) -> None:
        """Create the run directory for recipe ``name``, or check that it is this recipe's.

        ``identity`` holds the sections that must not change within a run (model, env);
        any other recipe, or the same recipe with another model or environment, is refused.
        """
        fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        path = self.root / "run.json"
        # A creator without hard links may be between its O_EXCL create and its write: wait.
        existing = self._read_run_json(path) if path.exists() else None
        if existing is None:
            if self.root.exists() and not self.root.is_dir():
                raise RunDirError(f"run directory {self.root} is a file; pass another --run-dir")
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                for sub in ("config", "registry", "rollouts", "weights", "checkpoints", "progress", "metrics",
                            "logs"):
                    (self.root / sub).mkdir(exist_ok=True)
            except OSError as e:  # a file in the way, no permission, a read-only filesystem, ...
                raise RunDirError(f"cannot create run directory {self.root} ({e.strerror}: {e.filename}); "
                                  "pass another --run-dir") from None
            record = json.dumps({"name": name, "fingerprint": fingerprint, "identity": identity,
                                 "created": time.time()}, indent=1, sort_keys=True).encode()
            if self._create_run_json(path, record):
                return
            existing = self._read_run_json(path)
        if existing.get("name") != name or existing.get("fingerprint") != fingerprint:
            what = "recipe" if existing.get("name") != name else "model or environment of recipe"
            raise RunDirError(
                f"run directory {self.root} belongs to {what} '{existing.get('name')}'; "
                "pass another --run-dir (or delete this one)"
            )

    def clean_small_temporaries(self) -> None:
        """Remove what writers of this host killed mid-write left among the small files (configs,
        registry, progress, rl-sync's status, pins); each process does this when it joins the run."""
        for sub in ("config", "registry", "progress", "sync", "weights/.pins"):
            clean_temporaries(self.root / sub)

    @staticmethod
    def _create_run_json(path: Path, record: bytes) -> bool:
        """Create run.json whole, or return False if another process created it first: the record is
        written and fsynced under a temporary name, then hard-linked to run.json (a link fails if the
        name exists), so run.json is never seen empty or torn, even after a kill or a full disk.
        Where the filesystem has no hard links, an exclusive create and a write in place."""
        tmp = path.with_name(f".{path.name}.tmp-{temp_tag()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(record)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                try:  # no hard links here: O_EXCL picks one creator (a reader retries while it writes)
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.write(record)
                    f.flush()
                    os.fsync(f.fileno())
            return True
        except OSError as e:
            full = storage_full(e, path)
            if full is not None:
                raise full from None
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def _read_run_json(self, path: Path) -> dict[str, Any]:
        for _ in range(50):  # a creator without hard links is between its O_EXCL create and its write
            try:
                return json.loads(path.read_text())
            except (json.JSONDecodeError, FileNotFoundError):
                time.sleep(0.02)
        raise RunDirError(f"{path} is unreadable; delete the run directory or pass another --run-dir")

    # ------------------------------------------------------------ steps
    def newest_intact(self, kind: str, skip: set[int] = frozenset()) -> int | None:
        """The newest STABLE step of ``kind`` ('weights', 'checkpoints'; not in ``skip``) whose
        directory passes :func:`~rlcli.transport.atomic.verify_dir`; each damaged newer one is
        named in a warning."""
        for step in reversed(self.stable_steps(kind)):
            if step in skip:
                continue
            directory = self.root / kind / f"step_{step}"
            problems = verify_dir(directory)
            if not problems:
                return step
            logging.getLogger("rlcli").warning("%s is damaged (%s); trying the one before", directory,
                                               "; ".join(problems))
        return None

    def stable_steps(self, kind: str) -> list[int]:
        """Sorted steps of ``kind`` ('weights', 'rollouts', 'checkpoints') that are complete."""
        parent = self.root / kind
        if not parent.is_dir():
            return []
        steps = []
        for child in parent.iterdir():
            m = _STEP_RE.match(child.name)
            if m and is_stable(child):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest_stable(self, kind: str) -> int | None:
        steps = self.stable_steps(kind)
        return steps[-1] if steps else None

    def resolve_weights(self, step: int) -> Path:
        """Directory holding policy ``step``'s tensors. Step 0 of an unmodified base model is
        a marker pointing at the model directory instead of a copy."""
        d = self.weights_dir(step)
        marker = read_marker(d) or {}
        return Path(marker.get("source") or d)

    # ------------------------------------------------------------ progress and metrics
    def write_progress(self, command: str, **fields: Any) -> None:
        write_checked_json(self.progress_file(command), {"time": time.time(), **fields}, fsync=False)

    def read_progress(self, command: str) -> dict[str, Any]:
        """The command's last progress record; {} when there is none or it is damaged (a
        checksum mismatch is logged), so a restart falls back to what the run directory's
        STABLE markers say, never to a corrupted counter."""
        path = self.progress_file(command)
        record = read_checked_json(path)
        if record is None and path.is_file():
            logging.getLogger("rlcli").warning("%s is damaged (checksum or JSON); ignoring it", path)
        return record or {}

    def append_metrics(self, command: str, record: dict[str, Any]) -> None:
        """Append ``record`` to RUN/metrics/<command>.jsonl, then mirror it to every attached sink
        (W&B, TensorBoard; see :mod:`rlcli.transport.sinks`). A failing sink is dropped with a warning."""
        path = self.metrics_file(command)
        path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        try:
            with open(path, "ab+") as f:
                if f.seek(0, os.SEEK_END):
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":  # a write cut short (a kill, a full disk) left a torn line:
                        line = b"\n" + line  # it stays alone, skipped by readers, and this record is whole
                f.write(line)
        except OSError as e:
            full = storage_full(e, path)
            if full is not None:
                raise full from None
            raise
        self._mirror(lambda sink: sink.log(command, record))

    def mirror_samples(self, command: str, step: int, records: list[dict[str, Any]]) -> None:
        """Readable samples (already in their JSON-lines file) to every attached sink, as a table."""
        self._mirror(lambda sink: sink.log_samples(command, step, records))

    def _mirror(self, call) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as e:  # monitoring never stops a run
                logging.getLogger("rlcli").warning("metrics sink %s failed and is dropped: %s",
                                                   type(sink).__name__, e)
                self.sinks.remove(sink)

    def read_metrics(self, command: str) -> list[dict[str, Any]]:
        """All complete records (a partially written last line is skipped)."""
        try:
            text = self.metrics_file(command).read_text(errors="replace")  # a damaged byte spoils one line
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def write_config(self, command: str, text: str) -> None:
        atomic_write_bytes(self.config_file(command), text.encode(), fsync=False)
