"""A line chart as a PNG with nothing but the standard library (the GPU machines
have no package registry, and matplotlib is not installed there): white
background, a frame, light grid lines, one coloured polyline per series. No
text: say what the colours are where the PNG is shown."""
from __future__ import annotations

import struct
import zlib

COLOURS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189)]


def _png(width: int, height: int, rows: list[bytearray]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    raw = b"".join(b"\x00" + bytes(r) for r in rows)  # filter type 0 per row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def line_chart(series: list[list[float]], width: int = 800, height: int = 480, margin: int = 30) -> bytes:
    """series: lists of y values at x = 0, 1, ...; all share the axes (x from 0 to the longest, y from the
    smallest to the largest finite value)."""
    rows = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def put(x: int, y: int, c):
        if 0 <= x < width and 0 <= y < height:
            rows[y][3 * x:3 * x + 3] = bytes(c)

    finite = [v for s in series for v in s if v == v and abs(v) != float("inf")]
    if not finite:
        raise ValueError("line_chart: no finite value to plot")
    lo, hi = min(finite), max(finite)
    if hi == lo:
        hi = lo + 1.0
    n = max(len(s) for s in series)
    x0, x1, y0, y1 = margin, width - margin, height - margin, margin

    def px(i: int, v: float):
        return (x0 + round((x1 - x0) * i / max(1, n - 1)), y0 - round((y0 - y1) * (v - lo) / (hi - lo)))

    for k in range(1, 10):  # grid
        gx, gy = x0 + (x1 - x0) * k // 10, y0 - (y0 - y1) * k // 10
        for y in range(y1, y0 + 1, 3):
            put(gx, y, (225, 225, 225))
        for x in range(x0, x1 + 1, 3):
            put(x, gy, (225, 225, 225))
    for x in range(x0, x1 + 1):  # frame
        put(x, y0, (0, 0, 0)), put(x, y1, (0, 0, 0))
    for y in range(y1, y0 + 1):
        put(x0, y, (0, 0, 0)), put(x1, y, (0, 0, 0))
    for s, colour in zip(series, COLOURS * (len(series) // len(COLOURS) + 1)):
        last = None
        for i, v in enumerate(s):
            if not (v == v and abs(v) != float("inf")):
                last = None
                continue
            p = px(i, v)
            if last is not None:  # a straight segment, one pixel per step along its longer side
                steps = max(abs(p[0] - last[0]), abs(p[1] - last[1]), 1)
                for t in range(steps + 1):
                    put(last[0] + round((p[0] - last[0]) * t / steps), last[1] + round((p[1] - last[1]) * t / steps),
                        colour)
            last = p
    return _png(width, height, rows)
