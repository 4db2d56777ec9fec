"""The taxonomy is data: every example line matches its signature, every near miss does not."""

from __future__ import annotations

import pytest
from helpers import ROOT

from elastic_diag.core.taxonomy import FAILURE_CLASSES, load_taxonomy, parse_signatures
from elastic_diag.errors import TaxonomyError

TAX = load_taxonomy()
LINE_SIGNATURES = [s for s in TAX if s.patterns]


@pytest.mark.parametrize("sig", LINE_SIGNATURES, ids=lambda s: s.id)
def test_examples_match(sig):
    assert sig.examples, f"{sig.id} has patterns but no example line"
    for line in sig.examples:
        assert sig.search(line), f"{sig.id} does not match its own example {line!r}"


@pytest.mark.parametrize("sig", [s for s in LINE_SIGNATURES if s.near_misses], ids=lambda s: s.id)
def test_near_misses_do_not_match(sig):
    for line in sig.near_misses:
        assert not sig.search(line), f"{sig.id} matches its near miss {line!r}"


def test_every_signature_is_complete():
    assert len(TAX) >= 15
    for s in TAX:
        assert s.failure_class in FAILURE_CLASSES
        assert s.meaning and s.fix and s.verify and s.confirm, s.id
        for sib in s.siblings:
            TAX.get(sib)


def test_exception_and_signal_lookup():
    assert TAX.for_exception("MemoryError").id == "memory-error"
    assert TAX.for_exception("torch.OutOfMemoryError").id == "cuda-oom"
    assert TAX.for_exception("KeyError").id == "python-exception"
    assert TAX.for_signal("SIGSEGV").id == "segfault"
    assert TAX.for_signal("SIGABRT").id == "abort"
    assert TAX.for_signal("SIGKILL").id == "killed"


def test_nccl_watchdog_fields_are_parsed():
    sig = TAX.get("nccl-watchdog-timeout")
    m = sig.search(sig.examples[0])
    assert m["seq"] == "2841" and m["op"] == "ALLREDUCE" and m["timeout_ms"] == "600000" and m["ran_ms"] == "600031"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[signature]]\nid='x'", "lacks the required field"),
        (
            "[[signature]]\nid='x'\nclass='nope'\ntitle='t'\nrole_hint='initiating'\nretryable=true\n"
            "meaning='m'\nfix='f'\nverify='v'",
            "unknown class",
        ),
        ("[[signature]\n", "not valid TOML"),
        ("[[signature]]\nid='x'\nbogus=1", "unknown fields"),
    ],
)
def test_malformed_data_is_named(text, message):
    with pytest.raises(TaxonomyError, match=message):
        parse_signatures(text, "bad.toml")


def test_signature_docs_are_not_stale():
    """docs/signatures/ is generated from the data: regenerate with
    `elastic-diag signatures --write-docs docs/signatures` after editing a TOML file."""

    from elastic_diag.report.signature_docs import expected_pages

    folder = ROOT / "docs" / "signatures"
    pages = expected_pages()
    on_disk = {p.name: p.read_text(encoding="utf-8") for p in folder.glob("*.md")}
    assert set(on_disk) == set(pages), "pages added or removed: regenerate docs/signatures"
    stale = [name for name, text in pages.items() if on_disk[name] != text]
    assert not stale, f"stale pages: {stale}; regenerate docs/signatures"


def test_every_signature_line_passes_the_analyzers_prefilter():
    """The offline analyzer looks only at lines holding one of its ANCHORS (for speed): every example
    line of every signature must hold one, or `elastic-diag analyze` would never see it."""
    from elastic_diag.offline.files import ANCHORS

    for sig in TAX:
        for line in sig.examples:
            assert any(a.decode() in line for a in ANCHORS), f"{sig.id}: no anchor in {line!r}"
