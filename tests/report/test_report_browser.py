"""report.html in a real browser: headless Chromium (Debian's chromium package, started here) loads
the page from a file with the network off, and the DOM and the pixels show the verdict and the
timeline. The screenshot is kept in test-artifacts/ (CI keeps it; open it to see the page)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
import zlib

import pytest
from helpers import FIXTURES, ROOT

from elastic_diag.report.html import write_html
from elastic_diag.report.timeline import ROLE_COLOURS

ARTIFACTS = ROOT / "test-artifacts"
FIXTURE = FIXTURES / "reports" / "desync"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Off the network, no background services: the machine's closed network would refuse their
# connections; an unreachable address makes any fetch the page tried fail loudly instead.
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
    "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
]  # fmt: skip

pytestmark = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("ELASTIC_DIAG_REQUIRE_BROWSER") != "1",
    reason="needs Debian's chromium package (apt-get install chromium); .ci/run installs it",
)


def chromium(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    if CHROMIUM is None:
        pytest.fail("ELASTIC_DIAG_REQUIRE_BROWSER=1 but no chromium on PATH")
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip


def decode_png(data: bytes) -> tuple[int, int, list[bytes], int]:
    """Width, height, rows of raw pixels and bytes per pixel of an 8-bit RGB/RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, (depth, colour_type, interlace)
    bpp = 3 if colour_type == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows, bpp


def longest_run(rows: list[bytes], bpp: int, colour: str) -> int:
    """The longest horizontal run of pixels of ``colour`` (#rrggbb, within a small tolerance)."""
    want = bytes.fromhex(colour[1:])
    best = 0
    for row in rows:
        run = 0
        for i in range(0, len(row), bpp):
            if all(abs(row[i + k] - want[k]) <= 6 for k in range(3)):
                run += 1
                best = max(best, run)
            else:
                run = 0
    return best


def test_chromium_renders_the_verdict_and_the_timeline(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    page, problems = write_html(run)
    assert problems == []
    url = page.as_uri()

    dom = chromium("--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Initiating rank 2 on vm" in dom.stdout and "collective_desync" in dom.stdout
    assert dom.stdout.count('<svg class="timeline"') == 2  # around the failure, and the whole attempt
    assert "verdict + teardown" in dom.stdout

    shot = tmp_path / "report.png"
    result = chromium(f"--screenshot={shot}", "--window-size=1100,1500", url)
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "report-desync.png")
    width, height, rows, bpp = decode_png(shot.read_bytes())
    assert (width, height) == (1100, 1500)
    # the timeline's bars were painted: a long red bar for the initiating rank, orange for the collateral
    assert longest_run(rows, bpp, ROLE_COLOURS["initiating"]) >= 300
    assert longest_run(rows, bpp, ROLE_COLOURS["collateral"]) >= 300
