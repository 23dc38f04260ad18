"""Line charts as PNG files, with numpy and the standard library only.

The orchestrator writes ``RUN/reward.png`` at the end of a run. matplotlib is the
obvious tool, but it is a large dependency (a font cache, a backend choice, seconds
of first import) for one picture, and this project keeps its dependency list small.
A readable line chart needs little: a raster, thick anti-aliased segments, a bitmap
font, "nice" tick values (1, 2 or 5 x 10^k) and a PNG encoder, which is one zlib
stream in CRC-checked chunks. That is this module.

The image is an (H, W, 3) float array. A series is painted as a coverage mask (for
each pixel, the maximum over segments of a ramp on its distance to the segment), so
joints are not painted twice and stay as wide as the segments; the mask is cut to the
plot area and blended in once. The file is written atomically, so a reader (or a
browser refreshing the run directory) never sees half a PNG.
"""

import math
import struct
import zlib
from pathlib import Path

import numpy as np

from rlcli.transport.atomic import atomic_write_bytes

# 5x7 glyphs, one hex number per row, bit 4 = leftmost column. Letters with
# descenders (g j p q y) have two more rows below the baseline.
_GLYPHS = {
    "0": "0E 11 13 15 19 11 0E", "1": "04 0C 04 04 04 04 0E", "2": "0E 11 01 02 04 08 1F",
    "3": "1F 02 04 02 01 11 0E", "4": "02 06 0A 12 1F 02 02", "5": "1F 10 1E 01 01 11 0E",
    "6": "06 08 10 1E 11 11 0E", "7": "1F 01 02 04 08 08 08", "8": "0E 11 11 0E 11 11 0E",
    "9": "0E 11 11 0F 01 02 0C",
    "A": "0E 11 11 1F 11 11 11", "B": "1E 11 11 1E 11 11 1E", "C": "0E 11 10 10 10 11 0E",
    "D": "1C 12 11 11 11 12 1C", "E": "1F 10 10 1E 10 10 1F", "F": "1F 10 10 1E 10 10 10",
    "G": "0E 11 10 17 11 11 0F", "H": "11 11 11 1F 11 11 11", "I": "0E 04 04 04 04 04 0E",
    "J": "07 02 02 02 02 12 0C", "K": "11 12 14 18 14 12 11", "L": "10 10 10 10 10 10 1F",
    "M": "11 1B 15 15 11 11 11", "N": "11 11 19 15 13 11 11", "O": "0E 11 11 11 11 11 0E",
    "P": "1E 11 11 1E 10 10 10", "Q": "0E 11 11 11 15 12 0D", "R": "1E 11 11 1E 14 12 11",
    "S": "0F 10 10 0E 01 01 1E", "T": "1F 04 04 04 04 04 04", "U": "11 11 11 11 11 11 0E",
    "V": "11 11 11 11 11 0A 04", "W": "11 11 11 15 15 15 0A", "X": "11 11 0A 04 0A 11 11",
    "Y": "11 11 11 0A 04 04 04", "Z": "1F 01 02 04 08 10 1F",
    "a": "00 00 0E 01 0F 11 0F", "b": "10 10 16 19 11 11 1E", "c": "00 00 0E 10 10 11 0E",
    "d": "01 01 0D 13 11 11 0F", "e": "00 00 0E 11 1F 10 0E", "f": "06 09 08 1C 08 08 08",
    "g": "00 00 0F 11 11 11 0F 01 0E", "h": "10 10 16 19 11 11 11", "i": "04 00 0C 04 04 04 0E",
    "j": "02 00 06 02 02 02 02 12 0C", "k": "10 10 12 14 18 14 12", "l": "0C 04 04 04 04 04 0E",
    "m": "00 00 1A 15 15 11 11", "n": "00 00 16 19 11 11 11", "o": "00 00 0E 11 11 11 0E",
    "p": "00 00 1E 11 11 11 1E 10 10", "q": "00 00 0F 11 11 11 0F 01 01",
    "r": "00 00 16 19 10 10 10", "s": "00 00 0F 10 0E 01 1E", "t": "08 08 1C 08 08 09 06",
    "u": "00 00 11 11 11 13 0D", "v": "00 00 11 11 11 0A 04", "w": "00 00 11 11 15 15 0A",
    "x": "00 00 11 0A 04 0A 11", "y": "00 00 11 11 11 11 0F 01 0E", "z": "00 00 1F 02 04 08 1F",
    ".": "00 00 00 00 00 0C 0C", ",": "00 00 00 00 0C 04 08", "-": "00 00 00 1F 00 00 00",
    "+": "00 04 04 1F 04 04 00", "_": "00 00 00 00 00 00 1F", ":": "00 0C 0C 00 0C 0C 00",
    "/": "00 01 02 04 08 10 00", "(": "02 04 08 08 08 04 02", ")": "08 04 02 02 02 04 08",
    "%": "18 19 02 04 08 13 03", "=": "00 00 1F 00 1F 00 00", " ": "00 00 00 00 00 00 00",
}
_UNKNOWN = "1F 11 11 11 11 11 1F"  # a box, so a missing glyph is visible rather than silent
_CELL_H, _ADVANCE = 9, 6  # rows per glyph cell (7 + 2 descender), columns per character


def _bits(rows: str) -> np.ndarray:
    values = [int(r, 16) for r in rows.split()]
    values += [0] * (_CELL_H - len(values))
    return np.array([[v >> (4 - c) & 1 for c in range(5)] for v in values], dtype=bool)


_FONT = {ch: _bits(rows) for ch, rows in _GLYPHS.items()}
_UNKNOWN_BITS = _bits(_UNKNOWN)

# Colors: tableau-10, which stay distinct for the usual handful of series.
_PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
            (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
_INK, _GRID, _FRAME = (30, 30, 30), (228, 228, 228), (160, 160, 160)


def moving_average(values, window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start), same length as
    ``values``. Non-finite values are skipped; an entry whose window holds none is NaN."""
    if window < 1:
        raise ValueError(f"moving_average window must be >= 1, got {window}")
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    ok = np.isfinite(x)
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, x, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    end = np.arange(1, len(x) + 1)
    start = np.maximum(end - window, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((sums[end] - sums[start]) / (counts[end] - counts[start])).tolist()


def _text_mask(text: str, scale: int) -> np.ndarray:
    mask = np.zeros((_CELL_H, max(len(text) * _ADVANCE - 1, 0)), dtype=bool)
    for i, ch in enumerate(text):
        mask[:, i * _ADVANCE:i * _ADVANCE + 5] = _FONT.get(ch, _UNKNOWN_BITS)
    return mask.repeat(scale, axis=0).repeat(scale, axis=1)


def _text_width(text: str, scale: int) -> int:
    return max(len(text) * _ADVANCE - 1, 0) * scale


def _blit(img: np.ndarray, mask: np.ndarray, x: int, y: int, color) -> None:
    """Paint ``mask`` with its top-left corner at pixel (x, y), cut to the image."""
    h, w = img.shape[:2]
    x0, y0, x1, y1 = max(x, 0), max(y, 0), min(x + mask.shape[1], w), min(y + mask.shape[0], h)
    if x0 < x1 and y0 < y1:
        img[y0:y1, x0:x1][mask[y0 - y:y1 - y, x0 - x:x1 - x]] = color


def _paint_segment(cov: np.ndarray, ax, ay, bx, by, radius: float) -> None:
    """Raise ``cov`` to the coverage of a round-capped segment of half-width ``radius``."""
    h, w = cov.shape
    pad = radius + 1.0
    c0, c1 = max(int(min(ax, bx) - pad), 0), min(int(max(ax, bx) + pad) + 2, w)
    r0, r1 = max(int(min(ay, by) - pad), 0), min(int(max(ay, by) + pad) + 2, h)
    if c0 >= c1 or r0 >= r1:
        return
    py, px = np.mgrid[r0:r1, c0:c1].astype(np.float64)
    dx, dy = bx - ax, by - ay
    len2 = dx * dx + dy * dy
    t = np.clip(((px - ax) * dx + (py - ay) * dy) / len2, 0.0, 1.0) if len2 > 0 else 0.0
    alpha = np.clip(radius + 0.5 - np.hypot(px - ax - t * dx, py - ay - t * dy), 0.0, 1.0)
    np.maximum(cov[r0:r1, c0:c1], alpha, out=cov[r0:r1, c0:c1])


def _nice_step(span: float, target: int) -> float:
    raw = span / max(target, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))


def _axis_range(values: list[float]) -> tuple[float, float]:
    """Range of the finite ``values`` (0..1 if none), padded if it is a single value."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    if lo == hi:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    return lo, hi


def _nice_range(lo: float, hi: float, target: int, snap: bool) -> tuple[float, float, float]:
    """(lo, hi, tick step); with ``snap`` the range is widened to multiples of the step."""
    step = _nice_step(hi - lo, target)
    if snap:
        lo, hi = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    return lo, hi, step


def _ticks(lo: float, hi: float, step: float) -> list[tuple[float, str]]:
    """Tick values at the multiples of ``step`` in [lo, hi], with their labels."""
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    values = [k * step for k in range(first, last + 1)]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    biggest = max(abs(lo), abs(hi))
    if biggest >= 1e6 or decimals > 5:  # fixed-point labels would be too long: use 1.5e+06
        digits = min(max(math.floor(math.log10(biggest)) - math.floor(math.log10(step)) + 1, 1), 10)
        fmt = lambda v: f"{v:.{digits}g}"  # noqa: E731
    else:
        fmt = lambda v: f"{v:.{decimals}f}"  # noqa: E731
    return [(v, "0" if abs(v) < step * 1e-6 else fmt(v)) for v in values]


def _encode_png(img: np.ndarray) -> bytes:
    """RGB8 PNG; every row uses filter 0 (None), which zlib compresses well enough here."""
    h, w, _ = img.shape
    raw = np.zeros((h, 1 + 3 * w), dtype=np.uint8)
    raw[:, 1:] = img.reshape(h, 3 * w)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
            + chunk(b"IEND", b""))


def line_plot_png(path: str | Path, series: dict[str, tuple[list[float], list[float]]], *,
                  title: str = "", xlabel: str = "", ylabel: str = "", width: int = 800,
                  height: int = 500, y_range: tuple[float, float] | None = None) -> None:
    """Write a line chart of ``series`` (name -> (xs, ys)) to ``path`` as a PNG.

    Non-finite points are skipped. ``y_range`` fixes the y axis (lines are cut to it);
    otherwise both axes are widened to nice tick values around the data.
    """
    if width < 160 or height < 120:
        raise ValueError(f"plot size must be at least 160x120, got {width}x{height}")
    if y_range is not None and not (math.isfinite(y_range[0]) and math.isfinite(y_range[1])
                                    and y_range[0] < y_range[1]):
        raise ValueError(f"y_range must be two finite numbers, low < high; got {y_range}")
    points = {}
    for name, (xs, ys) in series.items():
        if len(xs) != len(ys):
            raise ValueError(f"series {name!r} has {len(xs)} x values but {len(ys)} y values")
        xy = np.asarray([xs, ys], dtype=np.float64).reshape(2, -1)
        points[name] = xy[:, np.isfinite(xy).all(axis=0)]
    all_x = [float(v) for xy in points.values() for v in xy[0]]
    all_y = [float(v) for xy in points.values() for v in xy[1]]

    s = max(1, min(width, height) // 250)  # text scale: 5x7 glyphs at 2x on an 800x500 chart
    pad, tick_len, gap, cell = 5 * s, 3 * s, 2 * s + 1, _CELL_H * s
    title_s = s + 1
    while title_s > 1 and _text_width(title, title_s) > width - 2 * pad:
        title_s -= 1
    y_target = max(3, height // 80)
    ylo, yhi, ystep = _nice_range(*(y_range or _axis_range(all_y)), y_target, snap=y_range is None)
    yticks = _ticks(ylo, yhi, ystep)
    top = pad + (cell // s * title_s + pad if title else 2 * pad)
    left = (pad + (cell + pad if ylabel else 0) + max(_text_width(t, s) for _, t in yticks)
            + tick_len + gap)
    bottom = tick_len + gap + cell + (pad + cell if xlabel else 0) + pad
    x_target = max(3, (width - left) // (40 * s + 40))
    xlo, xhi, xstep = _nice_range(*_axis_range(all_x), x_target, snap=True)
    xticks = _ticks(xlo, xhi, xstep)
    right = max(3 * pad, _text_width(xticks[-1][1], s) // 2 + pad)
    x0, y0, x1, y1 = left, top, width - right, height - bottom  # plot area, inclusive pixels

    def to_px(x, y):
        return x0 + (x - xlo) / (xhi - xlo) * (x1 - x0), y1 - (y - ylo) / (yhi - ylo) * (y1 - y0)

    img = np.full((height, width, 3), 255.0)
    for v, _ in yticks:
        img[round(to_px(xlo, v)[1]), x0:x1 + 1] = _GRID
    for v, _ in xticks:
        img[y0:y1 + 1, round(to_px(v, ylo)[0])] = _GRID

    ink = np.zeros((height, width))  # where any series is drawn, for placing the legend
    inside = np.zeros((height, width), dtype=bool)
    inside[y0:y1 + 1, x0:x1 + 1] = True
    radius = 0.75 * s + 0.5  # 2.5 px wide lines at s=2
    colors = {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(points)}
    for name, xy in points.items():
        px, py = to_px(xy[0], xy[1])
        cov = np.zeros((height, width))
        for i in range(max(len(px) - 1, 0)):
            _paint_segment(cov, px[i], py[i], px[i + 1], py[i + 1], radius)
        if len(px) <= 40:  # few points: mark them, so a lone point is visible at all
            for x, y in zip(px, py):
                _paint_segment(cov, x, y, x, y, radius + s)
        cov *= inside
        img += (np.asarray(colors[name], dtype=np.float64) - img) * cov[..., None]
        np.maximum(ink, cov, out=ink)

    img[y0, x0:x1 + 1] = img[y1, x0:x1 + 1] = _INK
    img[y0:y1 + 1, x0] = img[y0:y1 + 1, x1] = _INK
    for v, label in yticks:
        y = round(to_px(xlo, v)[1])
        img[y - s // 2:y + (s + 1) // 2, x0 - tick_len:x0] = _INK
        _blit(img, _text_mask(label, s), x0 - tick_len - gap - _text_width(label, s),
              y - 7 * s // 2, _INK)
    for v, label in xticks:
        x = round(to_px(v, ylo)[0])
        img[y1 + 1:y1 + 1 + tick_len, x - s // 2:x + (s + 1) // 2] = _INK
        _blit(img, _text_mask(label, s), x - _text_width(label, s) // 2, y1 + tick_len + gap, _INK)
    if xlabel:
        _blit(img, _text_mask(xlabel, s), (x0 + x1 - _text_width(xlabel, s)) // 2,
              height - pad - cell, _INK)
    if ylabel:
        _blit(img, np.rot90(_text_mask(ylabel, s)), pad,  # reads bottom to top
              (y0 + y1 - _text_width(ylabel, s)) // 2, _INK)
    if title:
        mask = _text_mask(title, title_s)
        mask[:, 1:] |= mask[:, :-1]  # bold
        _blit(img, mask, (width - mask.shape[1]) // 2, pad, _INK)
    if points:
        _draw_legend(img, ink, (x0, y0, x1, y1), colors, s, radius)
    atomic_write_bytes(path, _encode_png(np.clip(np.rint(img), 0, 255).astype(np.uint8)))


def _draw_legend(img, ink, plot_box, colors, s, radius) -> None:
    """A boxed legend in whichever inner corner of the plot covers the least data."""
    x0, y0, x1, y1 = plot_box
    pad, sample, row = 4 * s, 12 * s, _CELL_H * s + 2 * s
    gap = 4 * s  # between the sample line's round cap and the name
    w = pad + sample + gap + max(_text_width(n, s) for n in colors) + pad
    h = 2 * pad + row * len(colors) - 2 * s
    inset = 3 * s
    corners = [(x0 + inset, y0 + inset), (x1 - inset - w, y0 + inset),
               (x0 + inset, y1 - inset - h), (x1 - inset - w, y1 - inset - h)]
    corners = [(max(x, 0), max(y, 0)) for x, y in corners]  # a legend wider than the plot
    lx, ly = min(corners, key=lambda c: ink[c[1]:c[1] + h, c[0]:c[0] + w].sum())
    w, h = min(w, img.shape[1] - lx), min(h, img.shape[0] - ly)  # names are cut at the edge
    img[ly:ly + h, lx:lx + w] = 255.0
    img[ly, lx:lx + w] = img[ly + h - 1, lx:lx + w] = _FRAME
    img[ly:ly + h, lx] = img[ly:ly + h, lx + w - 1] = _FRAME
    for i, (name, color) in enumerate(colors.items()):
        ty = ly + pad + i * row
        cov = np.zeros(img.shape[:2])
        mid = ty + 7 * s / 2 - 0.5
        _paint_segment(cov, lx + pad + radius, mid, lx + pad + sample - radius, mid, radius)
        img += (np.asarray(color, dtype=np.float64) - img) * cov[..., None]
        _blit(img, _text_mask(name, s), lx + pad + sample + gap, ty, _INK)
