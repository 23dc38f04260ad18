"""DeepGEMM's JIT warm-up: compile, before the first step, every kernel the process's token counts can pick.

DeepGEMM compiles one kernel per GEMM kind, N, K (and expert count) and *tile configuration*,
on first use, and keeps it on disk (``$DG_JIT_CACHE_DIR``, default ``~/.deep_gemm``). The
configuration is chosen from M, the micro-batch's token count (expert rows for grouped GEMMs),
which changes from one RL step to the next: on one H200 a 1.7B MoE's FP8 loop spent 37-50 s
compiling inside each step whose micro-batches met a new token count (docs/benchmarks.md, tenth
session).

:func:`warm_up` runs every FP8 GEMM shape of a converted model at every M up to the process's
bound on a grid fine enough that no M in between picks another configuration. DeepGEMM's SM90
heuristic, as its public source reads, sees a dense M through tile counts ``ceil(M / block_m)``
(block_m 16, 32, 64, 128, 256) and through comparisons of M with multiples of 8 (``M <= 16``,
``block_m <= M``, multicast from ``M >= 512``), so every M in ``(8j - 8, 8j]`` picks what ``8j``
picks: the dense grid is every multiple of 8. On the H200 this grid left no checked M uncovered,
while a coarser one that the same reading allows (multiples of 64, and 15, 31, 63, ...) missed
M = 1, so the 2.5 build differs from that reading somewhere below 16 (docs/benchmarks.md, eleventh
session). A grouped GEMM's M is its padded row count (a multiple of the contiguous layout's
alignment): one call per padded total. The linears' weight gradients (DeepGEMM's 1D1D kernel,
whose K is the token count, padded to 128) run at every multiple of 128. It calls the backend's
own methods, so the warm-up runs exactly the kernels (layouts, scale formats, padding) a step will.

Shapes are spread over worker processes, one shape per worker at a time: DeepGEMM's Python entry
points hold the GIL while nvcc runs, so threads would compile one kernel at a time. Every grid M
runs a real GEMM, so a sweep's device time grows with the square of its bound: the 1.7B MoE's
rl-train at 8,192 tokens took 166 s with a cold cache (6,974 calls, 278 kernels) and 33 s warm
(7,298 calls, with the weight gradients). Under expert parallelism the experts' bound is ``ep``
times a rank's rows, so a large ``ep`` with long micro-batches makes the sweep long;
``fp8.jit_warmup_tokens`` and a cache kept from an earlier run shorten it. The sweep's effect is
checked: :class:`WarmupReport` counts the kernels compiled and those a few off-grid token counts
compiled afterwards (``missed``, expected 0). Warm-ups on one host share the cache (rl-infer's and
rl-train's start together), so each sweeps under a shared lock beside it and checks under an
exclusive one (:func:`cache_lock`): a check waits for the other sweeps, and counts only its own misses.

    python -m rlcli.ops.fp8.warmup JOBS.json   # a worker: runs the jobs, prints one JSON line
"""

import contextlib
import fcntl
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn

from rlcli.ops.fp8 import runtime
from rlcli.ops.fp8.backends import padded_rows
from rlcli.ops.fp8.quant import BLOCK, ceil_div
from rlcli.transport.registry import expect_long

log = logging.getLogger("rlcli.fp8")

M_STEP = 8
"""Grid of dense token counts: every multiple of this (DeepGEMM's tile sizes along M and the thresholds
it compares M with are all multiples of it)."""


@dataclass(frozen=True)
class GemmShape:
    """One FP8 GEMM of a model: ``op`` "gemm" (``[M, k] . [n, k]^T``), "grouped" (``groups`` experts) or
    "wgrad" (a weight gradient ``[n, M] . [k, M]^T`` on DeepGEMM's 1D1D kernel, M the tokens)."""

    op: str
    n: int
    k: int
    groups: int = 0


@dataclass
class WarmupReport:
    shapes: int = 0
    calls: int = 0
    compiled: int = 0  # new kernels in the JIT cache during the sweep (another warm-up's beside it included)
    missed: int = 0  # new kernels while off-grid token counts ran after it (the grid's check, alone on the cache)
    seconds: float = 0.0
    workers: int = 0
    errors: list[str] = field(default_factory=list)


def cache_dir() -> Path:
    return Path(os.environ.get("DG_JIT_CACHE_DIR") or Path.home() / ".deep_gemm") / "cache"


@contextlib.contextmanager
def cache_lock(exclusive: bool) -> Iterator[None]:
    """``flock`` on a file beside the JIT cache: warm-ups hold it shared while they sweep and exclusive while
    they check, so no other warm-up on the host compiles into the cache while one counts its misses. The
    registry hears this process is busy while it waits (``expect_long``). Where the file cannot be made
    (a read-only cache), nothing is locked."""
    path = cache_dir().parent / "rlcli-warmup.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("a")
    except OSError as e:  # a read-only cache (compiled elsewhere): nothing compiles into it, nothing to order
        log.debug("no warm-up lock at %s (%s)", path, e)
        yield
        return
    with f:
        while True:
            try:
                fcntl.flock(f, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                expect_long(60.0)
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_kernels() -> int:
    d = cache_dir()
    return sum(1 for _ in d.iterdir()) if d.is_dir() else 0


def model_shapes(model: nn.Module, backward: bool, ep: int = 1) -> list[GemmShape]:
    """The distinct FP8 GEMMs ``model``'s converted modules run: forward, and with ``backward`` the input
    gradient's (weights transposed) and the linears' weight gradients (DeepGEMM's 1D1D kernel, compiled
    whether or not the first step's measurement then picks it over cuBLASLt's: :meth:`DeepGemmBackend.gemm_1x128`;
    the experts' weight gradients are bf16). Stacked sibling sets run as one GEMM over their stacked
    outputs; experts are split over ``ep`` ranks. Shapes are read from the modules' declared (global)
    shapes, so a model on the meta device, before parallelization, will do."""
    from rlcli.ops.fp8.convert import FP8GroupedExperts
    from rlcli.ops.fp8.linear import FP8Linear

    shapes: dict[GemmShape, None] = {}
    for module in model.modules():
        if isinstance(module, FP8Linear):
            group = module.sibling_group
            if group is not None and module is not group.members[0]:
                continue
            n = sum(group.splits) if group is not None else module.out_features
            shapes[GemmShape("gemm", n, module.in_features)] = None
            if backward:
                shapes[GemmShape("gemm", module.in_features, n)] = None
                shapes[GemmShape("wgrad", n, module.in_features)] = None
        elif isinstance(module, FP8GroupedExperts):
            for w in (module.w_gate, module.w_up, module.w_down):
                g, n, k = w.shape  # a DTensor's shape is the global one
                g //= ep
                shapes[GemmShape("grouped", n, k, g)] = None
                if backward:
                    shapes[GemmShape("grouped", k, n, g)] = None
    return list(shapes)


def m_grid(max_m: int, step: int = M_STEP) -> list[int]:
    """Dense token counts to sweep: every multiple of ``step`` up to ``max_m`` rounded up to one."""
    return list(range(step, ceil_div(max_m, step) * step + 1, step))


def k_grid(max_tokens: int) -> list[int]:
    """Token counts for weight gradients, where the tokens are the GEMM's K, padded to a multiple of 128:
    one per padded K."""
    return list(range(BLOCK, ceil_div(max_tokens, BLOCK) * BLOCK + 1, BLOCK))


def grouped_grid(max_rows: int, groups: int, align: int) -> list[int]:
    """Expert-row counts, one per padded total (:func:`padded_rows`, the grouped GEMM's M) that 1 to
    ``max_rows`` rows can give: the fewest rows giving each."""
    extra = groups * (align - 1)
    lo, hi = padded_rows(1, groups, align) // align, padded_rows(max_rows, groups, align) // align
    ms = [max(1, align * (c - 1) - extra + 1) for c in range(lo, hi + 1)]
    assert all(padded_rows(m, groups, align) == align * c for m, c in zip(ms, range(lo, hi + 1)))
    return ms


def _run_job(backend, shape: GemmShape, ms: list[int], device: torch.device, ue8m0: bool) -> int:
    """Every M of ``ms`` through the backend's own entry point for ``shape``; returns the calls made."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    if shape.op != "wgrad":  # a weight gradient's operands are both activations
        w = (torch.randn((shape.groups or 1) * shape.n, shape.k, generator=gen) * 0.02).to(device, torch.bfloat16)
        wq, ws = runtime.quantize_weight(w.view(shape.groups, shape.n, shape.k) if shape.op == "grouped" else w, ue8m0)
    x_max = torch.randn(max(ms), shape.k, generator=gen).to(device, torch.bfloat16)
    dy_max = torch.randn(max(ms), shape.n, generator=gen).to(device, torch.bfloat16) if shape.op == "wgrad" else None
    for m in ms:
        x = x_max[:m].contiguous()
        if shape.op == "grouped":  # rows spread evenly over the experts (the padded total depends on M only)
            counts = torch.full((shape.groups,), m // shape.groups, dtype=torch.int64)
            counts[: m % shape.groups] += 1
            offs = torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)
            backend.grouped_gemm_x(x, ue8m0, wq, ws, offs, torch.bfloat16)
        elif shape.op == "wgrad":  # as rlcli.ops.fp8.linear.wgrad quantizes, on DeepGEMM's kernel
            aq, sa = runtime.quantize_act(dy_max[:m].contiguous(), ue8m0, rows=False, cols=True)
            bq, sb = runtime.quantize_act(x, ue8m0, rows=False, cols=True)
            backend._wgrad_1d1d(aq, sa, bq, sb)
        else:
            xq, xs = runtime.quantize_act(x, ue8m0)
            backend.gemm(xq, xs, wq, ws, torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(ms)


def _jobs(shapes: list[GemmShape], max_tokens: int, max_rows: int, align: int,
          tokens: list[int] | None = None, rows: list[int] | None = None) -> list[tuple[GemmShape, list[int]]]:
    dense = sorted(set(tokens)) if tokens else m_grid(max_tokens)
    ks = sorted({ceil_div(t, BLOCK) * BLOCK for t in tokens}) if tokens else k_grid(max_tokens)

    def ms(s: GemmShape) -> list[int]:
        if s.op == "wgrad":
            return ks
        if s.op == "grouped":
            return sorted(set(rows)) if rows else grouped_grid(max_rows, s.groups, align)
        return dense

    return [(s, ms(s)) for s in shapes]


def run_jobs(jobs: list[tuple[GemmShape, list[int]]], device: torch.device, ue8m0: bool) -> tuple[int, list[str]]:
    """Run ``jobs`` in this process on a strict DeepGEMM backend: (calls made, one error line per failed shape)."""
    from rlcli.ops.fp8.backends import DeepGemmBackend, import_deep_gemm

    dg = import_deep_gemm()
    if dg is None:
        return 0, ["deep_gemm does not import"]
    if device.type == "cuda" and device.index is not None:  # "cuda" alone: the current device
        torch.cuda.set_device(device)
    backend = DeepGemmBackend(dg, strict=True)
    calls, errors = 0, []
    for shape, ms in jobs:
        try:
            calls += _run_job(backend, shape, ms, device, ue8m0)
        except (RuntimeError, AssertionError, TypeError) as e:
            errors.append(f"{shape}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return calls, errors


def _spawn(jobs: list[tuple[GemmShape, list[int]]], device: torch.device, ue8m0: bool, workdir: Path, i: int):
    """A worker process on ``jobs``; its stdout and stderr go to files in ``workdir`` (a pipe nobody reads
    while it runs would stop a worker that writes more than the pipe holds)."""
    spec = workdir / f"jobs-{i}.json"
    spec.write_text(json.dumps({"device": str(device), "ue8m0": ue8m0,
                                "jobs": [[asdict(s), ms] for s, ms in jobs]}))
    with (workdir / f"out-{i}").open("w") as out, (workdir / f"err-{i}").open("w") as err:
        return subprocess.Popen([sys.executable, "-m", "rlcli.ops.fp8.warmup", str(spec)], stdout=out, stderr=err)


def _sweep(jobs: list[tuple[GemmShape, list[int]]], workers: int, device: torch.device, ue8m0: bool,
           report: WarmupReport) -> None:
    """Run ``jobs`` here (``workers`` 0) or over ``workers`` processes, adding calls and errors to ``report``."""
    if workers == 0:
        report.calls, report.errors = run_jobs(jobs, device, ue8m0)
        return
    jobs = sorted(jobs, key=lambda j: -len(j[1]) * j[0].n * j[0].k * max(1, j[0].groups))  # longest first
    parts = [jobs[i::workers] for i in range(workers)]
    with tempfile.TemporaryDirectory(prefix="rlcli-dg-warmup-") as tmp:
        procs = {i: _spawn(p, device, ue8m0, Path(tmp), i) for i, p in enumerate(parts) if p}
        while any(p.poll() is None for p in procs.values()):
            expect_long(60.0)
            time.sleep(1.0)
        for i, p in procs.items():
            out = (Path(tmp) / f"out-{i}").read_text()
            try:
                res = json.loads(out.strip().splitlines()[-1])
                report.calls += res["calls"]
                report.errors += res["errors"]
            except (IndexError, ValueError, KeyError):
                err = (Path(tmp) / f"err-{i}").read_text(errors="replace")
                report.errors.append(f"a warm-up worker exited {p.returncode}: {err.strip()[-300:]}")


def warm_up(shapes: list[GemmShape], *, max_tokens: int, max_rows: int, device: torch.device | str,
            ue8m0: bool = False, workers: int | None = None, align: int = BLOCK, check: int = 4,
            tokens: list[int] | None = None, rows: list[int] | None = None) -> WarmupReport:
    """Sweep ``shapes`` (dense M up to ``max_tokens``, expert rows up to ``max_rows``; or exactly the dense
    token counts ``tokens`` and expert row counts ``rows``, where given, and then no check) in ``workers``
    processes (default: one per shape, at most the host's cores less two, at most 16; 0 runs them here).
    Then ``check`` random off-grid M per shape run here and count what they compile (``missed``). The
    registry hears this process is busy while it waits (``expect_long``)."""
    device = torch.device(device)
    report = WarmupReport(shapes=len(shapes))
    if not shapes:
        return report
    t0 = time.monotonic()
    jobs = _jobs(shapes, max_tokens, max_rows, align, tokens, rows)
    if workers is None:
        workers = min(len(jobs), max(1, (os.cpu_count() or 2) - 2), 16)
    report.workers = workers
    with cache_lock(exclusive=False):  # other processes' sweeps may run beside this one
        before = cached_kernels()
        _sweep(jobs, workers, device, ue8m0, report)
        report.compiled = cached_kernels() - before
    if check and not report.errors and not (tokens or rows):
        rng = random.Random(0)
        bound = {s: max_rows if s.op == "grouped" else max_tokens for s in shapes}
        checks = [(s, sorted(rng.sample(range(1, bound[s] + 1), min(check, bound[s])))) for s in shapes]
        with cache_lock(exclusive=True):  # no other warm-up compiles into the cache meanwhile: the count is ours
            after = cached_kernels()
            calls, errors = run_jobs(checks, device, ue8m0)
            report.missed = cached_kernels() - after
        report.calls += calls
        report.errors += errors
    report.seconds = time.monotonic() - t0
    return report


def warm_up_model(model: nn.Module, *, max_tokens: int, top_k: int = 1, ep: int = 1, backward: bool,
                  device: torch.device | str, ue8m0: bool = False, workers: int | None = None,
                  tokens: list[int] | None = None) -> WarmupReport | None:
    """:func:`warm_up` for the FP8 GEMMs of ``model`` when its backend is DeepGEMM (None otherwise).
    ``max_tokens`` bounds a micro-batch's tokens on this rank; expert rows are bounded by
    ``max_tokens * top_k * ep`` (under expert parallelism every rank may send this one all its rows).
    ``tokens``: the only token counts a micro-batch can have, where known (rows of one length); the
    experts' rows are then ``top_k`` times those, except under expert parallelism, where routing
    decides them (their whole grid is swept)."""
    from rlcli.ops.fp8.backends import DeepGemmBackend

    backend = next((m.backend for m in model.modules() if isinstance(getattr(m, "backend", None), DeepGemmBackend)),
                   None)
    if backend is None:
        return None
    shapes = model_shapes(model, backward, ep)
    rows = [t * max(1, top_k) for t in tokens] if tokens and ep <= 1 else None
    report = warm_up(shapes, max_tokens=max_tokens, max_rows=max_tokens * max(1, top_k) * max(1, ep),
                     device=device, ue8m0=ue8m0, workers=workers, align=backend.align, tokens=tokens, rows=rows)
    log.info("fp8 JIT warm-up (deep_gemm): %d shapes, %d calls in %d processes, %d kernels compiled, %s, "
             "%.1f s (cache %s)%s", report.shapes, report.calls, report.workers, report.compiled,
             f"token counts {sorted(set(tokens))}" if tokens else f"{report.missed} missed by the grid",
             report.seconds, cache_dir(),
             "; errors: " + "; ".join(report.errors[:3]) if report.errors else "")
    return report


def _worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    jobs = [(GemmShape(**s), ms) for s, ms in spec["jobs"]]
    calls, errors = run_jobs(jobs, torch.device(spec["device"]), spec["ue8m0"])
    print(json.dumps({"calls": calls, "errors": errors}), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1])
