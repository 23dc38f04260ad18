"""Triton's CPU interpreter for the kernel tests.

Triton picks the interpreter (``TRITON_INTERPRET=1``) when a kernel is defined, and torch may
import triton before any test runs, so a test cannot switch it on for itself: the tests that need
it run in a child pytest process that has the variable from its start (:func:`run_child`); in
the parent they are skipped. Some Triton releases' interpreters fail under newer numpy (3.5 and
3.6 under numpy 2.4: a loop over a runtime bound raises "only 0-dimensional arrays can be
converted"); :func:`unusable` probes that once and names it.
"""

import functools
import importlib.util
import os
import subprocess
import sys

ACTIVE = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether this process runs under the interpreter (the child)."""

_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def k(X, N, B: tl.constexpr):
    acc = tl.zeros([B], dtype=tl.float32)
    for i in range(0, N, B):
        acc += tl.load(X + i + tl.arange(0, B), mask=i + tl.arange(0, B) < N, other=0.0)
    tl.store(X + tl.arange(0, B), acc)
x = torch.ones(40)
k[(1,)](x, 40, B=16)
assert x[0].item() == 3.0, x
"""


@functools.cache
def unusable() -> str | None:
    """Why the interpreter cannot run the kernel tests here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    proc = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=120)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"Triton's interpreter fails here ({last[:200]})"
    return None


def run_child(test_file: str, env: dict[str, str] | None = None, timeout: float = 900) -> None:
    """Run ``test_file`` in a child pytest under the interpreter; fail with its output unless every
    test it ran passed (and it ran at least one)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", test_file],
                          env={**os.environ, "TRITON_INTERPRET": "1", **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0 and " passed" in proc.stdout, tail


def run_child_or_skip(test_file: str, env: dict[str, str] | None = None, timeout: float = 900) -> None:
    """:func:`run_child`, or skip the calling test naming why the interpreter cannot run here."""
    import pytest

    reason = unusable()
    if reason:
        pytest.skip(reason)
    run_child(test_file, env, timeout)
