"""Drive Debian's headless Chromium from tests: DOM after load, screenshots, console messages.

No DevTools client is needed: `--enable-logging=stderr --v=0` prints every console
message (and every uncaught exception) as an `INFO:CONSOLE` line, `--dump-dom` prints
the DOM once the page's scripts have run, `--screenshot` writes a PNG.
"""
from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
import zlib

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--enable-logging=stderr", "--v=0",
         "--window-size=1400,900", "--hide-scrollbars")
CONSOLE = re.compile(r":CONSOLE[^\]]*\] (.*)")


def executable() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome", "headless_shell"):
        path = shutil.which(name)
        if path:
            return path
    return None


def run(url: str, *mode: str, timeout: int = 120) -> tuple[str, list[str]]:
    """(stdout, console messages) of one headless run with a fresh profile."""
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run([executable(), *FLAGS, f"--user-data-dir={profile}", *mode, url],
                              capture_output=True, text=True, timeout=timeout)
    console = [m.group(1) for m in map(CONSOLE.search, done.stderr.splitlines()) if m]
    return done.stdout, console


def dump_dom(url: str) -> tuple[str, list[str]]:
    return run(url, "--dump-dom")


def screenshot(url: str, path: str) -> list[str]:
    # the virtual-time budget lets frames (a notebook's iframe) finish painting before the capture
    _, console = run(url, f"--screenshot={path}", "--virtual-time-budget=5000")
    return console


def read_png(path: str) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG (what Chromium writes)."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and interlace == 0 and colour in (2, 6), header
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], prev[x - bpp] if x >= bpp else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def coloured_pixels(path: str, box: tuple[int, int, int, int]) -> int:
    """Pixels in box (x0, y0, x1, y1) that are not near-white (drawn nodes, edges, text)."""
    width, height, rows = read_png(path)
    bpp = len(rows[0]) // width
    x0, y0, x1, y1 = box
    count = 0
    for y in range(y0, min(y1, height)):
        row = rows[y]
        for x in range(x0, min(x1, width)):
            r, g, b = row[x * bpp:x * bpp + 3]
            count += min(r, g, b) < 235
    return count
