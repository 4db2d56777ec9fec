"""What masking secrets costs (not a timed test): print figures.

    python benchmarks/masking.py [--lines 200000] [--stream-mb 64]

print: a rank printing a realistic training line (step, loss, lr, tokens/s, grad norm, memory: the words
"tokens" and "-" put the line through the command-line-flag pattern, the worst common case) with
``print()``, to a file, plain and through :class:`elastic_diag.redaction.RedactingStream` (the worker's
sys.stdout under torchrun-diag); microseconds a print, the median of 5 rounds each.
fixtures: :func:`elastic_diag.redaction.mask_shapes` a line at a time over the 289 fixture logs of real runs
(what a line of real output costs), MB/s.
stream file: :func:`elastic_diag.redaction.redact_file` over a stream file of ``--stream-mb`` MB made of the
fixture logs repeated, with one secret near its end (what the launcher does to each rank's output when the
ranks exit), MB/s; and the same file with no secret-shaped text at all.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic_diag import redaction  # noqa: E402

LINE = "[rank3]: step 1234/100000 | loss 2.3456 | lr 3.0e-04 | tokens/s 123456 | grad_norm 1.234 | mem 23.4GB"


def _prints(stream: object, n: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        print(LINE, i, file=stream)  # type: ignore[call-overload]
    return (time.perf_counter() - t) / n * 1e6


def fixture_text() -> str:
    parts = []
    for path in sorted((ROOT / "tests" / "fixtures" / "logs").rglob("*")):
        if path.is_file() and path.suffix in (".log", ".txt", ".out", ".err"):
            parts.append(path.read_text(errors="replace"))
    return "".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--stream-mb", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "out.log"), "w") as f:
        masked = redaction.RedactingStream(f, redaction.Redactor({"s3cretApiKey"}))
        plain_us = statistics.median(_prints(f, args.lines // 5) for _ in range(5))
        masked_us = statistics.median(_prints(masked, args.lines // 5) for _ in range(5))
    print(f"print: plain {plain_us:.2f} us, through RedactingStream {masked_us:.2f} us "
          f"(+{masked_us - plain_us:.2f} us a print)")  # fmt: skip

    text = fixture_text()
    lines = text.splitlines()
    t = time.perf_counter()
    for line in lines:
        redaction.mask_shapes(line)
    dt = time.perf_counter() - t
    print(f"fixtures: {len(lines)} lines, {len(text) / 1e6:.1f} MB: {dt / len(lines) * 1e6:.2f} us a line, "
          f"{len(text) / 1e6 / dt:.1f} MB/s")  # fmt: skip

    data = text.encode()
    with tempfile.TemporaryDirectory() as tmp:
        for label, tail in (("one secret", b"\nexport HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyzABCDEFGH\n"),
                            ("nothing to mask", b"\n")):  # fmt: skip
            path = Path(tmp) / "stderr.log"
            with open(path, "wb") as out:
                written = 0
                while written < args.stream_mb << 20:
                    out.write(data)
                    written += len(data)
                out.write(tail)
            size = path.stat().st_size
            t = time.perf_counter()
            changed = redaction.redact_file(path, redaction.Redactor(set()))
            dt = time.perf_counter() - t
            print(f"stream file ({label}): {size / 1e6:.0f} MB in {dt:.2f} s = {size / 1e6 / dt:.0f} MB/s"
                  f" (rewritten: {changed})")  # fmt: skip


if __name__ == "__main__":
    main()
