"""Session fixtures of the model tests (configs and helpers live in ``zoo.py``)."""

from pathlib import Path

import pytest
import torch
from zoo import ARCHS, make_hf_model


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """``hf_model_dir(name) -> (directory saved by transformers, the transformers model)``."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str):
        if name not in cache:
            model = make_hf_model(name, seed=ARCHS.index(name))
            path = tmp_path_factory.mktemp(f"hf-{name}")
            model.save_pretrained(path)
            cache[name] = (path, model)
        return cache[name]

    return get
