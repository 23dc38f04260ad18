"""`rl-train sft` and `rl-train convert`."""

import time
from pathlib import Path

import torch

from rlcli.config import RecipeConfig
from rlcli.logging import setup_logging
from rlcli.models import DTYPES, load_model, save_model
from rlcli.models.tokenizer import load_tokenizer
from rlcli.train.sft import run_sft
from rlcli.transport.atomic import atomic_dir

log = setup_logging("rl-train")


def sft(cfg: RecipeConfig, out: Path) -> None:
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model.path, dtype=DTYPES[cfg.model.dtype], seed=cfg.seed)
    run_sft(cfg, model, load_tokenizer(cfg.model.path), log)
    with atomic_dir(out, {"sft_steps": cfg.train.sft.num_steps}) as tmp:
        save_model(model, tmp, source_dir=cfg.model.path)
    log.info("wrote %s", out)


def convert(source: str, out: Path, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Convert ``source`` (a .gguf path or a package that ships one) into ``out``; returns the .gguf read."""
    from rlcli.models.gguf import convert_gguf, find_packaged_gguf

    path = Path(source)
    if not path.exists() and not source.endswith(".gguf"):
        path = find_packaged_gguf(source)
    t0 = time.monotonic()
    convert_gguf(path, out, dtype=dtype, overwrite=overwrite)
    log.info("converted %s -> %s in %.1fs", path, out, time.monotonic() - t0)
    return path
