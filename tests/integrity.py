"""Flipping one byte of a durable file, as a bad disk or a torn copy would."""

from pathlib import Path


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte of ``path`` in place (the middle one by default); the size stays the same."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_marker_step(directory: Path) -> None:
    """Change one digit of the STABLE marker's step: still valid JSON, other bytes."""
    marker = directory / "STABLE"
    text = marker.read_text()
    key = '"step": '
    i = text.index(key) + len(key)
    marker.write_text(text[:i] + ("7" if text[i] != "7" else "8") + text[i + 1:])
