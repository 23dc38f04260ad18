import json
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "recipes" / "models" / "tiny-llama"


@pytest.fixture
def tiny_model_dir(tmp_path) -> Path:
    """A smaller copy of the demo's tiny Llama config (random weights, byte tokenizer)."""
    d = tmp_path / "tiny"
    d.mkdir()
    cfg = json.loads((TINY_MODEL / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16)
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copy(TINY_MODEL / "tokenizer_config.json", d / "tokenizer_config.json")
    return d


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
