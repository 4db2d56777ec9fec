"""faulthandler's dumps parsed (core/stacks.py): the main thread, whether it was inside a collective, the
user's own frame; anything that is not a dump is none. Pure."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_diag.core.stacks import OWN_THREAD_MARK, is_user_file, parse_stack_dump

DUMP = """--- elastic_diag dump hang-0 at 1.0 ---
Thread 0x00007f39fddc36c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/venv/lib/python3.11/site-packages/elastic_diag/worker/beacon.py", line 101 in _wait

Current thread 0x00007f39fec5eb80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/job/train.py", line 96 in step
  File "/job/train.py", line 120 in main
"""


def test_the_main_thread_is_the_last_and_it_waits_in_a_collective_at_the_users_line():
    dump = parse_stack_dump(DUMP)
    assert dump is not None and len(dump.threads) == 2
    assert dump.in_collective() is True
    assert str(dump.user_frame()) == "/job/train.py:96 in step"


def test_a_thread_outside_torch_is_not_in_a_collective():
    dump = parse_stack_dump('Current thread 0x1 (most recent call first):\n  File "/job/io.py", line 7 in read\n')
    assert dump is not None and dump.in_collective() is False and str(dump.user_frame()) == "/job/io.py:7 in read"


def test_what_is_not_a_dump_is_none():
    assert parse_stack_dump("") is None
    assert parse_stack_dump('  File "/job/train.py", line 9 in main\n') is None  # frames with no thread header


def test_user_files():
    assert is_user_file("/job/train.py")
    assert not is_user_file("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py")
    assert not is_user_file("/usr/lib/python3.11/threading.py") and not is_user_file("<frozen runpy>")
    assert not is_user_file("/src/elastic_diag/worker/beacon.py")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_parsing_never_raises(text):
    dump = parse_stack_dump(text)
    assert dump is None or dump.in_collective() in (True, False, None)


_BEACON_FIRST = """
--- elastic_diag dump stall-0-1 at 1796298793.103697 ---
Current thread 0x00007fa0b87ba6c0 (most recent call first):
  File "/venv/lib/python3.11/site-packages/elastic_diag/worker/beacon.py", line 168 in _answer_dump
  File "/venv/lib/python3.11/site-packages/elastic_diag/worker/beacon.py", line 121 in _run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00007fa0b9652b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4159 in barrier
  File "/job/train.py", line 49 in main
  File "/job/train.py", line 54 in <module>
"""


def test_the_stuck_thread_comes_first_and_the_tools_own_thread_last_and_marked():
    dump = parse_stack_dump(_BEACON_FIRST)
    assert dump is not None
    text = dump.for_people()
    assert text.index("Thread 0x00007fa0b9652b80") < text.index("Current thread 0x00007fa0b87ba6c0")
    assert "Current thread 0x00007fa0b87ba6c0 (most recent call first): [elastic_diag's own thread" in text
    assert text.startswith("\n--- elastic_diag dump stall-0-1")
    assert sorted(text.split()) == sorted((_BEACON_FIRST + OWN_THREAD_MARK).split())  # nothing lost or added
    single = parse_stack_dump(_BEACON_FIRST.split("\nThread")[0])
    assert single is not None and single.for_people() == single.text


def test_a_print_through_the_masking_stream_is_the_ranks_not_the_tools():
    """A rank blocked printing (a full pipe) has the masking stream's write innermost: still the rank's thread,
    its user frame the line that printed."""
    text = _BEACON_FIRST.replace(
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4159 in barrier\n',
        '  File "/venv/lib/python3.11/site-packages/elastic_diag/redaction.py", line 260 in write\n',
    )
    dump = parse_stack_dump(text)
    assert dump is not None
    assert not is_user_file(dump.main_thread[0].file) and is_user_file(dump.main_thread[1].file)
    out = dump.for_people()
    assert out.index("Thread 0x00007fa0b9652b80") < out.index("Current thread") and out.count(OWN_THREAD_MARK) == 1
