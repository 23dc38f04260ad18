"""Reading rollout batches from the run directory (and turning them into tensors).

A batch file is checked against the checksum in its directory's STABLE manifest (and that
marker against its own checksum) on the bytes already read for decoding (one read, no second
pass). A corrupt batch is not trained: the trainer unmarks and
deletes RUN/rollouts/step_N and keeps waiting; rl-orchestrate sees a step at or past the
trainer's that is missing and writes it again from fresh groups.
"""

import hashlib
import time
from pathlib import Path

import torch

from rlcli.protocol.batch import MicroBatch, TrainingBatch, decode_batch
from rlcli.errors import CorruptFile
from rlcli.transport.atomic import checksums_of, is_stable, marker_problem, read_marker
from rlcli.transport.checksum import verify
from rlcli.transport.rundir import RunDir


class BatchCorrupt(RuntimeError):
    pass


def batch_path(run: RunDir, step: int, rank: int) -> Path:
    return run.rollouts_dir(step) / f"{rank}.msgpack"


def wait_for_batch(run: RunDir, step: int, rank: int, timeout_s: float = 0.0, poll_s: float = 0.05,
                   should_stop=lambda: False, sleep=time.sleep,
                   num_ranks: int | None = None) -> tuple[TrainingBatch, str] | None:
    """Block until RUN/rollouts/step_<step> is STABLE, then read and verify this rank's file: the batch
    and the checksum its bytes matched (which batch was trained, for the metrics). Returns None on
    timeout or when ``should_stop()`` turns true. Between two looks at the marker
    it calls ``sleep(poll_s)``, which may return early (the trainer's wakes on rl-orchestrate's
    ``BatchWritten``). A batch split for other than ``num_ranks`` data-parallel ranks (the
    trainer's) is unusable: part of it would never be read, or a rank would find no file."""
    start = time.monotonic()
    directory = run.rollouts_dir(step)
    while not is_stable(directory):
        if should_stop() or (timeout_s and time.monotonic() - start > timeout_s):
            return None
        sleep(poll_s)
    path = batch_path(run, step, rank)
    bad_marker = marker_problem(directory)
    if bad_marker is not None:
        raise BatchCorrupt(bad_marker)
    if num_ranks is not None:
        split = (read_marker(directory) or {}).get("num_ranks")  # None: written before batches said
        if split is not None and split != num_ranks:
            raise BatchCorrupt(f"it is split for {split} trainer rank(s) but rl-train has {num_ranks} data-parallel "
                               f"rank(s): set orchestrate.num_train_ranks = {num_ranks} for rl-orchestrate")
    try:
        expected = checksums_of(directory).get(path.name)
        legacy = path.with_suffix(".msgpack.sha256")  # batches written before checksum manifests
        legacy_sum = legacy.read_text().strip() if expected is None and legacy.is_file() else None
        data = path.read_bytes()
    except FileNotFoundError as e:  # deleted under us (retention, or another rank found it corrupt)
        raise BatchCorrupt(f"{e.filename} is missing") from None
    if expected is None and legacy_sum is None:
        raise BatchCorrupt(f"{path} has no checksum in {directory / 'STABLE'}")
    try:
        verify(path, data, expected)
    except CorruptFile as e:
        raise BatchCorrupt(str(e)) from None
    if legacy_sum is not None and hashlib.sha256(data).hexdigest() != legacy_sum:
        raise BatchCorrupt(f"{path} does not match its sha256")
    try:
        return decode_batch(data), expected or legacy_sum
    except ValueError as e:  # msgspec.DecodeError / ValidationError: a wrong but self-consistent write
        raise BatchCorrupt(f"{path} does not decode: {e}") from None


def to_tensors(mb: MicroBatch, device: torch.device) -> dict:
    """[1, T] tensors of one packed micro-batch; with routes, also ``routes_range``: the smallest and
    largest expert index they name, read on the host (checking them on the device would sync)."""
    out = {}
    for name in ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "versions"):
        out[name] = torch.from_numpy(getattr(mb, name).numpy().copy()).to(device)[None]
    if mb.routed_experts is not None:
        routes = mb.routed_experts.numpy()
        out["routed_experts"] = torch.from_numpy(routes.astype("int64")).to(device)
        out["routes_range"] = (int(routes.min()), int(routes.max())) if routes.size else None
    return out
