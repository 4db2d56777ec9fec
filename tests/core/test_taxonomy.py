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
            "[[signature]]\nid='x'\nclass='nope'\ntitle='t'\nrole_hint='initiating'\nretryable=true\nblame='job'\n"
            "meaning='m'\nfix='f'\nverify='v'",
            "unknown class",
        ),
        (
            "[[signature]]\nid='x'\nclass='abort'\ntitle='t'\nrole_hint='initiating'\nretryable=true\nblame='gpu'\n"
            "meaning='m'\nfix='f'\nverify='v'",
            "blame must be one of",
        ),
        ("[[signature]\n", "not valid TOML"),
        ("[[signature]]\nid='x'\nbogus=1", "unknown fields"),
    ],
)
def test_malformed_data_is_named(text, message):
    with pytest.raises(TaxonomyError, match=message):
        parse_signatures(text, "bad.toml")


def test_only_host_faults_are_blamed_on_the_node():
    """A user's bug never counts against a host: every signature of the job's own classes is blamed on the job,
    and the node is blamed only for what the hardware or the host's network prints."""
    node = {s.id for s in TAX if s.blame == "node"}
    assert node == {"gpu-xid-ecc", "nccl-network-error", "nccl-remote-error", "node-lost"}
    for sig in TAX:
        if sig.failure_class in ("python_exception", "collective_desync", "collective_mismatch", "cuda_oom", "nan_inf"):
            assert sig.blame in ("job", "infra"), sig.id


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


def test_the_compiled_taxonomy_is_current():
    """load_taxonomy reads compiled.json (JSON, 1 ms) instead of the TOML files (30 ms) when its digest is theirs:
    after editing a TOML file, `python tools/compile_taxonomy.py` writes it again."""
    from importlib import resources

    from elastic_diag.core.taxonomy import COMPILED_FILE, compiled_taxonomy

    on_disk = (resources.files("elastic_diag.core.taxonomy") / COMPILED_FILE).read_text(encoding="utf-8")
    assert on_disk == compiled_taxonomy(), "stale: run python tools/compile_taxonomy.py"


def test_a_stale_compiled_taxonomy_is_not_used(tmp_path, monkeypatch):
    """A TOML file edited without compiling again: the TOML files are read (the digest differs), so an edit is
    never hidden by the cache."""
    import elastic_diag.core.taxonomy as taxonomy

    files = list(taxonomy._data_files())
    edited = [(name, text.replace('title = "', 'title = "EDITED ', 1)) for name, text in files]
    monkeypatch.setattr(taxonomy, "_data_files", lambda: iter(edited))
    taxonomy.load_taxonomy.cache_clear()
    try:
        assert any(s.title.startswith("EDITED ") for s in taxonomy.load_taxonomy())
    finally:
        taxonomy.load_taxonomy.cache_clear()


def test_patterns_compile_on_first_use_and_match_the_same():
    """The compiled taxonomy's patterns compile when a signature is first tried; they are the TOML's."""
    from elastic_diag.core.taxonomy import _data_files, parse_signatures

    fresh = {s.id: s for name, text in _data_files() for s in parse_signatures(text, name)}
    for sig in load_taxonomy():
        assert [p.pattern for p in sig.patterns] == [p.pattern for p in fresh[sig.id].patterns]


@pytest.mark.parametrize(
    ("line", "same"),
    [
        ("wandb: Network error (ReadTimeout), entering retry loop.", True),
        ("urllib3.exceptions.ReadTimeoutError: HTTPSConnectionPool(host='hf.co', port=443): Read timed out.", True),
        ("Token indices sequence length is longer than the specified maximum (2741 > 1024)", True),
        # a pattern that tells digits apart, and could match: "signal 11" is a segfault, "signal 15" is not
        ("Caught signal 11 (Segmentation fault)", False),
        ("OSError: [Errno 98] Address already in use", False),
        ("PermissionError: [Errno 13] Permission denied: '/ckpt'", False),
        # a process named by its number in the line
        ("process 3 terminated with signal SIGKILL", False),
    ],
)
def test_which_lines_answer_the_same_whatever_their_digits(line, same):
    """match_line_digits: the offline reader skips a line's repeats (other digits, same rank) only where no
    signature the literals admit could answer differently for other digits."""
    assert load_taxonomy().match_line_digits(line)[1] is same
