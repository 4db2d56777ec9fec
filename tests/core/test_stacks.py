"""faulthandler's dumps parsed (core/stacks.py): the main thread, whether it was inside a collective, the
user's own frame; anything that is not a dump is none. Pure."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_diag.core.stacks import is_user_file, parse_stack_dump

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
