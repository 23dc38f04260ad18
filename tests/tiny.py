"""The tiny test model: a smaller copy of the demo's Llama config (random weights, byte tokenizer)."""

import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "recipes" / "models" / "tiny-llama"


def write_tiny_model(d: Path, **overrides) -> Path:
    """Write config.json (the demo's, shrunk, then ``overrides``) and the tokenizer config to ``d``."""
    d.mkdir(parents=True)
    cfg = json.loads((TINY_MODEL / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16)
    cfg.update(overrides)
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copy(TINY_MODEL / "tokenizer_config.json", d / "tokenizer_config.json")
    return d
