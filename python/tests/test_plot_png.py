"""bench/plot_png.py: the dependency-free PNG line chart of the FP8 loss check."""
import struct
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from plot_png import COLOURS, line_chart  # noqa: E402


def _pixels(png: bytes):
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", None
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos:pos + 4])
        kind, data = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", png[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + data) & 0xFFFFFFFF
        if kind == b"IHDR":
            width, height = struct.unpack(">II", data[:8])
        elif kind == b"IDAT":
            idat += data
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = 1 + 3 * width
    assert len(raw) == stride * height
    return {tuple(raw[r * stride + 1 + 3 * x:r * stride + 4 + 3 * x]) for r in range(height) for x in range(width)}, (
        width, height)


def test_each_series_is_drawn_in_its_colour():
    colours, size = _pixels(line_chart([[3.0, 2.0, 1.5, 1.2], [3.0, 2.5, 2.0], [1.0, 1.0, 1.0, 1.0]], 200, 120))
    assert size == (200, 120)
    for c in COLOURS[:3]:
        assert c in colours
    assert COLOURS[3] not in colours  # only as many colours as series


def test_nothing_finite_is_an_error():
    with pytest.raises(ValueError, match="no finite value"):
        line_chart([[float("nan"), float("inf")]])
