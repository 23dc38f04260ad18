"""Tokenizers: token ids in, token ids out.

:class:`ByteTokenizer` serves tiny models built from a config: ids 0-255 are bytes, then a
few special tokens. A model directory selects it with ``"tokenizer_class": "ByteTokenizer"``
in ``tokenizer_config.json``; otherwise ``tokenizer.json`` is loaded with the ``tokenizers``
library (see :func:`load_tokenizer`).
"""

import json
from pathlib import Path
from typing import Protocol

from rlcli.errors import ModelLoadError


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then <bos>=256, <eos>=257, <pad>=258."""

    SPECIALS = ("<bos>", "<eos>", "<pad>")

    def __init__(self, add_bos: bool = True):
        self.add_bos = add_bos
        self.bos_token_id, self.eos_token_id, self.pad_token_id = 256, 257, 258
        self.eos_token_ids = [self.eos_token_id]
        self.vocab_size = 256 + len(self.SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens and self.add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out.extend(self.SPECIALS[i - 256].encode())
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    @staticmethod
    def config() -> dict:
        """tokenizer_config.json of a model directory that uses this tokenizer."""
        return {"tokenizer_class": "ByteTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
                "pad_token": "<pad>"}


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    if not str(model_dir):
        raise ModelLoadError("model.path is not set; set [model] path in the recipe or pass --model.path DIR")
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist; check model.path")
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if cfg.get("tokenizer_class") == "ByteTokenizer":
        return ByteTokenizer()
    if (model_dir / "tokenizer.json").is_file():
        from rlcli.models.hf_tokenizer import HFTokenizer

        return HFTokenizer(model_dir)
    raise ModelLoadError(f"{model_dir} has no tokenizer.json (and tokenizer_config.json does not name "
                         "ByteTokenizer); add the tokenizer files to the model directory")
