"""JSON lines read from a user's file or pipe: each bad line is an error that names it."""

import json
from typing import Any, Iterable, Iterator

from rlcli.errors import ConfigError


def check_text(line: str, where: str, number: int) -> str:
    """``line`` if it is text; a ConfigError naming ``where`` and the line if it held bytes that are
    not UTF-8. Python reads a pipe in UTF-8 mode with surrogateescape, so such bytes arrive as lone
    surrogates and would fail later, in the tokenizer or the JSON writer, without naming the line."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{where} line {number} is not UTF-8 text; convert it (e.g. iconv -t UTF-8)") from None
    return line


def json_objects(lines: Iterable[str], where: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-empty line; a line that is not a JSON object, or not
    UTF-8 text, is a ConfigError naming ``where`` (e.g. "stdin", or a file and the key that named
    it) and the line."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        check_text(line, where, number)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} line {number} is not JSON ({e.msg}); give one JSON object per line") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where} line {number} is a JSON {type(obj).__name__}, expected an object")
        yield number, obj
