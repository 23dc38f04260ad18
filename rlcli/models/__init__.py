"""Model architectures and Hugging Face checkpoint / tokenizer I/O. No distributed code.

The names below load on first use, so a process that only needs a tokenizer or a config
(rl-orchestrate, the client) does not import torch through this package."""

import importlib

_EXPORTS = {
    "ARCHITECTURES": "rlcli.models.config", "ModelArgs": "rlcli.models.config",
    "DTYPES": "rlcli.models.hf_io", "build_model": "rlcli.models.hf_io", "load_model": "rlcli.models.hf_io",
    "load_weights": "rlcli.models.hf_io", "save_model": "rlcli.models.hf_io",
    "CausalLM": "rlcli.models.transformer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
