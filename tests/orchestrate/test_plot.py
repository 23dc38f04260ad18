import math
import struct
import zlib

import numpy as np
import pytest

from rlcli.orchestrate.plot import line_plot_png, moving_average

BLUE = (31, 119, 180)  # the first series' color


def read_png(path) -> np.ndarray:
    """Decode an RGB8 PNG whose rows all use filter 0, checking structure and CRCs."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(tag + body), tag
        chunks.append((tag, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color_type, interlace) == (8, 2, 0)
    raw = zlib.decompress(b"".join(body for tag, body in chunks if tag == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(height, 1 + 3 * width)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(height, width, 3)


def color_mask(img: np.ndarray, color) -> np.ndarray:
    return (np.abs(img.astype(int) - color) <= 8).all(axis=-1)


def test_png_structure_and_size(tmp_path):
    path = tmp_path / "out" / "reward.png"
    line_plot_png(path, {"reward": ([0, 1, 2], [0.1, 0.5, 0.3])}, width=640, height=360)
    img = read_png(path)
    assert img.shape == (360, 640, 3)
    assert (img[0, 0] == 255).all()  # white background
    assert [p.name for p in path.parent.iterdir()] == ["reward.png"]  # no temporary left behind


def test_rising_series_is_drawn_rising(tmp_path):
    path = tmp_path / "up.png"
    xs = list(range(100))
    line_plot_png(path, {"reward": (xs, [x / 100 for x in xs])}, title="up")
    img = read_png(path)
    rows, cols = np.nonzero(color_mask(img, BLUE))
    assert len(rows) > 200
    left, right = cols < np.quantile(cols, 0.3), cols > np.quantile(cols, 0.7)
    assert rows[left].mean() > rows[right].mean() + 100  # image rows grow downwards


def test_series_get_distinct_colors(tmp_path):
    path = tmp_path / "two.png"
    xs = list(range(10))
    line_plot_png(path, {"raw": (xs, xs), "smooth": (xs, moving_average(xs, 3))})
    img = read_png(path)
    orange = (255, 127, 14)
    assert color_mask(img, BLUE).sum() > 100 and color_mask(img, orange).sum() > 100


def test_title_draws_dark_pixels_in_top_margin(tmp_path):
    xy = {"reward": ([0, 1], [0.0, 1.0])}
    line_plot_png(tmp_path / "a.png", xy, title="Reward over steps")
    line_plot_png(tmp_path / "b.png", xy)
    with_title, without = read_png(tmp_path / "a.png"), read_png(tmp_path / "b.png")
    dark = lambda img: (img[:30].max(axis=-1) < 100).sum()  # noqa: E731
    assert dark(with_title) > 200
    assert dark(without) < dark(with_title) / 4


def test_labels_and_ticks_draw_text(tmp_path):
    line_plot_png(tmp_path / "a.png", {}, xlabel="step", ylabel="reward")
    img = read_png(tmp_path / "a.png")
    dark = img.max(axis=-1) < 100
    assert dark[-20:].sum() > 30  # x label in the bottom margin
    assert dark[:, :20].sum() > 30  # rotated y label in the left margin


@pytest.mark.parametrize("series", [
    {},
    {"r": ([], [])},
    {"r": ([0, 1, 2], [math.nan] * 3)},
    {"r": ([0, 1, 2, 3], [0.1, math.nan, math.inf, 0.4])},
    {"r": ([5], [0.5])},
    {"r": ([0, 1, 2], [0.0, 0.0, 0.0])},
    {"r": ([3, 3], [1e9, 1e9])},
    {"r": ([0, 1e7], [1e-7, 3e-7]), "s": ([0, 1], [-1, 1])},
    {"a series name far too long to fit in the legend box of a chart this wide " * 3: ([0], [1])},
])
def test_edge_cases_do_not_crash(tmp_path, series):
    line_plot_png(tmp_path / "e.png", series, title="edge case (x=1%)", y_range=None)
    assert read_png(tmp_path / "e.png").shape == (500, 800, 3)


def test_single_point_is_visible(tmp_path):
    line_plot_png(tmp_path / "p.png", {"r": ([3], [0.5])})
    assert color_mask(read_png(tmp_path / "p.png"), BLUE).sum() > 20


def test_y_range_clips_lines_to_plot_area(tmp_path):
    line_plot_png(tmp_path / "c.png", {"r": ([0, 1], [-5.0, 5.0])}, y_range=(0.0, 1.0), title="T")
    img = read_png(tmp_path / "c.png")
    rows, _ = np.nonzero(color_mask(img, BLUE))
    frame_rows = np.nonzero((img.max(axis=-1) < 60).sum(axis=1) > 400)[0]  # the axes box
    assert rows.min() >= frame_rows.min() and rows.max() <= frame_rows.max()


def test_invalid_arguments():
    with pytest.raises(ValueError, match="y_range"):
        line_plot_png("/nonexistent/x.png", {}, y_range=(1.0, 1.0))
    with pytest.raises(ValueError, match="'r'"):
        line_plot_png("/nonexistent/x.png", {"r": ([0, 1], [0.0])})


def test_moving_average():
    assert moving_average([1, 2, 3, 4, 5], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert moving_average([1, 2, 3], 10) == [1.0, 1.5, 2.0]
    assert moving_average([4, 5], 1) == [4.0, 5.0]
    assert moving_average([], 3) == []
    out = moving_average([math.nan, 2, math.nan, 4], 2)
    assert math.isnan(out[0]) and out[1:] == [2.0, 2.0, 4.0]
    values = np.random.default_rng(0).normal(size=500)
    expected = [values[max(0, i - 49):i + 1].mean() for i in range(500)]
    np.testing.assert_allclose(moving_average(values, 50), expected, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError):
        moving_average([1.0], 0)
