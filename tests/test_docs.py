"""The documentation builds with MkDocs with warnings as errors, and its generated pages say what the
code says: every option of the parsers, every injection of the examples."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)  # fmt: skip
    assert build.returncode == 0, build.stderr[-4000:]
    assert "WARNING" not in build.stderr, build.stderr[-4000:]
    return out


def text_of(page: Path) -> str:
    return re.sub(r"<[^>]+>", " ", page.read_text())


def test_every_parser_option_is_in_the_cli_reference(site):
    from elastic_diag.cli import get_parser as elastic_diag_parser
    from elastic_diag.launch.arguments import get_parser as torchrun_diag_parser

    page = (site / "cli-reference" / "index.html").read_text()
    options = [o for a in torchrun_diag_parser()._actions for o in a.option_strings if o not in ("-h", "--help")]
    assert any(o.startswith("--diag-") for o in options)
    for option in options:
        assert option in page, option
    for name, sub in elastic_diag_parser()._subparsers._group_actions[0].choices.items():  # type: ignore[union-attr]
        assert f"elastic-diag {name}" in page
        for a in sub._actions:
            for option in a.option_strings:
                assert option in page or option in ("-h", "--help"), (name, option)


def test_every_injection_is_in_the_examples_page(site):
    from helpers import injection_tables

    TABLES = injection_tables()

    page = text_of(site / "examples" / "index.html")
    for table in TABLES.values():
        for inject, cls in table.items():
            assert re.search(rf"{re.escape(inject)}\s+{re.escape(cls)}", page), (inject, cls)


def test_the_pages_the_issue_asks_for_are_built(site):
    for page in ("quickstart", "how-it-works", "comparison", "adding-a-signature", "signatures"):
        assert (site / page / "index.html").is_file(), page
    assert (site / "img" / "report-hang.png").is_file()
    assert len(list((site / "signatures").glob("*/index.html"))) >= 30


def test_a_broken_link_fails_the_build(tmp_path):
    """--strict really is strict here: a page with a dead link does not build."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "quickstart.md").write_text((docs / "quickstart.md").read_text() + "\n[gone](no-such-page.md)\n")
    config = (ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
    config = config.replace("tools/docs_hooks.py", str(ROOT / "tools" / "docs_hooks.py"))
    (tmp_path / "mkdocs.yml").write_text(config)
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"),
                            "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                           timeout=110, check=False)  # fmt: skip
    assert build.returncode != 0 and "no-such-page.md" in build.stderr
