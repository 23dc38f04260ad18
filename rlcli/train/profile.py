"""Where a training step's time goes: one profiled step, and the peak memory of every step.

``train.profile_step = N`` runs step N under ``torch.profiler``. Each rank writes a Chrome
trace to RUN/profiles/train-step<N>-rank<r>.json (written whole, then renamed), and the
step's metrics gain the time of its collectives by kind, largest over the ranks:
``comm_all_to_all_s`` (expert parallelism's dispatch and combine; NCCL runs it as
SendRecv kernels), ``comm_all_gather_s`` (FSDP2's parameter gathers, context
parallelism's K/V), ``comm_reduce_scatter_s`` (FSDP2's gradients), ``comm_all_reduce_s``.
On a GPU these are device kernel times (they overlap compute on their own streams, so a
share of the step is an upper bound on what they cost it); on a CPU, the time gloo's
collectives were in flight.

On CUDA every step also records ``peak_mem_gib``: the largest
``torch.cuda.max_memory_allocated`` of any rank during the step. Every step records
``compile_graphs`` (graphs torch.compile built during the step: FlexAttention, its block mask,
compiled blocks; after the first steps of a shape, a non-zero count is a recompile) and
``compile_fallbacks`` (frames torch.compile gave up on during the step: a recompile limit reached,
or code it cannot trace; such a frame runs eagerly from then on and is counted once), largest over the ranks (:func:`compile_counts`).
"""

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from rlcli.parallel import dist as pdist

COMM_KINDS = {
    "all_to_all": ("alltoall", "sendrecv"),
    "all_gather": ("allgather",),
    "reduce_scatter": ("reducescatter",),
    "all_reduce": ("allreduce",),
}
"""Metric suffix -> substrings of an event's name (lower case, underscores removed)."""


def comm_kind(name: str) -> str | None:
    """The collective kind an event or kernel name belongs to (None: not a collective)."""
    key = name.lower().replace("_", "")
    for kind, needles in COMM_KINDS.items():
        if any(n in key for n in needles):
            return kind
    return None


def comm_seconds(events, cuda: bool) -> dict[str, float]:
    """Seconds per collective kind in ``prof.key_averages()``: device time of the kernels on a
    GPU; on a CPU the span of gloo's own events (``gloo:all_to_all``, ...: the collective in
    flight, whichever thread waits for it), never the c10d wrappers around them."""
    out = dict.fromkeys(COMM_KINDS, 0.0)
    for e in events:
        kind = comm_kind(e.key)
        if kind is None:
            continue
        if cuda:
            out[kind] += e.self_device_time_total / 1e6
        elif e.key.startswith("gloo:"):
            out[kind] += e.cpu_time_total / 1e6
    return out


@contextmanager
def step_profile(root: Path, step: int, rank: int, device: torch.device, enabled: bool) -> Iterator[dict]:
    """Profile the step when ``enabled``; the yielded dict receives this rank's
    ``comm_<kind>_s`` once the block ends (reduce them with :func:`reduce_max`)."""
    found: dict[str, float] = {}
    if not enabled:
        yield found
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield found
        if cuda:
            torch.cuda.synchronize(device)
    found.update({f"comm_{k}_s": v for k, v in comm_seconds(prof.key_averages(), cuda).items()})
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"train-step{step}-rank{rank}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, path)


def reduce_max(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """The largest value of each key over every rank (all ranks pass the same keys)."""
    if not values:
        return {}
    keys = sorted(values)
    t = pdist.all_reduce_max(torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device))
    return dict(zip(keys, t.tolist()))


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> dict[str, float]:
    """``{"peak_mem_gib": ...}`` of this rank's step on CUDA; empty elsewhere."""
    if device.type != "cuda":
        return {}
    return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def compile_counts() -> dict[str, float]:
    """This process's torch.compile totals so far: ``compile_graphs`` (graphs built) and
    ``compile_fallbacks`` (frames it gave up on; each runs eagerly from then on). Zero
    while torch._dynamo was never imported: nothing was compiled, and reading its counters
    must not import it."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {"compile_graphs": 0.0, "compile_fallbacks": 0.0}
    frames = utils.counters["frames"]
    return {"compile_graphs": float(utils.counters["stats"]["unique_graphs"]),
            "compile_fallbacks": float(frames["total"] - frames["ok"])}
