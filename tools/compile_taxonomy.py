"""Writes elastic_diag/core/taxonomy/compiled.json: the signature TOML files' tables as JSON with the digest of
the files, read by load_taxonomy at start-up instead of the TOML (tests/core/test_taxonomy.py checks it is current).

    python tools/compile_taxonomy.py
"""

from __future__ import annotations

from pathlib import Path

from elastic_diag.core.taxonomy import COMPILED_FILE, compiled_taxonomy

if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "elastic_diag" / "core" / "taxonomy" / COMPILED_FILE
    out.write_text(compiled_taxonomy(), encoding="utf-8")
    print(f"wrote {out}")
