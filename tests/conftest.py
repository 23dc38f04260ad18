import os
from pathlib import Path

import pytest
from tiny import write_tiny_model


@pytest.fixture
def tiny_model_dir(tmp_path) -> Path:
    """A smaller copy of the demo's tiny Llama config (random weights, byte tokenizer)."""
    return write_tiny_model(tmp_path / "tiny")


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
