"""The worker bootstrap, in real Python subprocesses started the way the launcher starts them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import worker_env

from elastic_diag import layout
from elastic_diag.core.stacks import parse_stack_dump
from elastic_diag.worker import bootstrap


def test_uncaught_exception_is_recorded_with_precise_time(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import time\ndef f():\n    raise KeyError('shard-7')\nf()\n")
    before = time.time()
    p = subprocess.run([sys.executable, str(script)], env=worker_env(tmp_path / "r"), capture_output=True, text=True,
                       timeout=30)  # fmt: skip
    assert p.returncode == 1
    assert "KeyError: 'shard-7'" in p.stderr  # the user's own traceback is still printed
    rec = json.loads((tmp_path / "r" / "exception.json").read_text())
    assert rec["type"] == "KeyError" and rec["message"] == "'shard-7'"
    assert "line 3, in f" in rec["traceback"]
    assert before <= rec["time"] <= time.time() and rec["time"] != int(rec["time"])
    err = json.loads((tmp_path / "r" / "error.json").read_text())
    assert err["message"]["message"] == "KeyError: 'shard-7'"  # torchelastic's format, for its summary


def test_stack_dump_on_signal_while_blocked(tmp_path):
    script = tmp_path / "s.py"
    # 'ready' from inside stuck(): the signal must not arrive before the main thread is in it
    script.write_text("import time\ndef stuck():\n    print('ready', flush=True)\n    time.sleep(60)\nstuck()\n")
    p = subprocess.Popen([sys.executable, str(script)], env=worker_env(tmp_path / "r"), stdout=subprocess.PIPE,
                         text=True)  # fmt: skip
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # the line is read while print() may still be returning through the masking stream
        os.kill(p.pid, bootstrap.DUMP_SIGNAL)
        stacks = tmp_path / "r" / "stacks.txt"
        # faulthandler writes the dump in pieces (one per thread; the beacon is a second thread): read it
        # once its size has stopped changing
        deadline, last = time.monotonic() + 10, -1
        while time.monotonic() < deadline:
            size = stacks.stat().st_size if stacks.exists() else 0
            if size and size == last:
                break
            last = size
            time.sleep(0.2)
        dump = parse_stack_dump(stacks.read_text())
        assert dump is not None
        assert dump.main_thread[0].func == "stuck" and dump.in_collective() is False
        assert p.poll() is None  # the dump signal does not kill
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def test_children_do_not_inherit_and_original_sitecustomize_still_runs(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['ORIGINAL_SITECUSTOMIZE'] = 'ran'\n")
    script = tmp_path / "s.py"
    script.write_text(
        "import os, subprocess, sys, json\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get(\"ELASTIC_DIAG_RANK_DIR\"),"
        ' os.environ.get("PYTHONPATH"))\'], capture_output=True, text=True).stdout.strip()\n'
        "print(json.dumps({'child': child, 'orig': os.environ.get('ORIGINAL_SITECUSTOMIZE')}))\n"
    )
    p = subprocess.run([sys.executable, str(script)], env=worker_env(tmp_path / "r", str(site)), capture_output=True,
                       text=True, timeout=30)  # fmt: skip
    out = json.loads(p.stdout)
    assert out["orig"] == "ran"
    assert out["child"] == f"None {site}"
    assert (tmp_path / "r" / "worker.json").exists()


def test_fatal_signal_leaves_python_stack_in_stderr(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import ctypes\ndef crash():\n    ctypes.string_at(0)\ncrash()\n")
    p = subprocess.run([sys.executable, str(script)], env=worker_env(tmp_path / "r"), capture_output=True, text=True,
                       timeout=30)  # fmt: skip
    assert p.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in p.stderr
    assert "in crash" in p.stderr


def test_the_beacon_waits_for_torch_to_finish_importing(tmp_path, monkeypatch):
    """The beacon's thread can tick while the main thread is still importing torch: a module that is
    in sys.modules but not yet initialised must be retried on the next tick, not stop the beacon
    (seen once in the suite: 'partially initialized module torch.optim.optimizer')."""
    import sys
    import types

    from elastic_diag.worker import beacon

    half = types.ModuleType("torch.optim.optimizer")  # what sys.modules holds halfway through the import
    monkeypatch.setitem(sys.modules, "torch.optim.optimizer", half)
    if "torch" not in sys.modules:
        monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    with open(tmp_path / "stacks.txt", "w") as stacks:
        b = beacon.Beacon(str(tmp_path), 0.05, stacks)
        b.tick()  # must not raise
        assert not b.hooks_installed
        assert (tmp_path / layout.PROGRESS_FILE).exists()


def _run(tmp_path: Path, code: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "s.py"
    script.write_text(code)
    rank_dir = tmp_path / "r"
    p = subprocess.run([sys.executable, str(script)], env=worker_env(rank_dir), capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    return p, rank_dir


def test_the_class_hierarchy_and_the_chain_are_recorded(tmp_path):
    """A MemoryError subclass is known for one (numpy's _ArrayMemoryError); a cleanup's error raised
    while handling the rank's own keeps the rank's own in its chain."""
    p, rank_dir = _run(tmp_path, (
        "class ShardMemoryError(MemoryError):\n    pass\n"
        "try:\n    raise ShardMemoryError('batch of 8 TiB')\n"
        "except MemoryError:\n    raise RuntimeError('Connection closed by peer during the emergency save')\n"
    ))  # fmt: skip
    assert p.returncode == 1
    rec = json.loads((rank_dir / "exception.json").read_text())
    assert rec["type"] == "RuntimeError" and rec["mro"][:2] == ["RuntimeError", "Exception"]
    assert rec["chain"] == [["ShardMemoryError", "batch of 8 TiB"]]
    from elastic_diag.layout import read_exception

    got = read_exception(rank_dir)
    assert got is not None and got.chain == (("ShardMemoryError", "batch of 8 TiB"),)


def test_an_exception_that_resists_printing_is_still_recorded(tmp_path):
    p, rank_dir = _run(tmp_path, (
        "class BadStr(Exception):\n    def __str__(self):\n        raise RuntimeError('__str__ exploded')\n"
        "raise BadStr()\n"
    ))  # fmt: skip
    assert p.returncode == 1 and "BadStr" in p.stderr  # Python's own hook still prints it
    rec = json.loads((rank_dir / "exception.json").read_text())
    assert rec["type"] == "BadStr" and rec["message"] == "<str() raised RuntimeError>"
    assert rec["problems"] == ["str() raised RuntimeError"]


def test_a_huge_message_is_cut_and_says_so(tmp_path):
    p, rank_dir = _run(tmp_path, "raise ValueError('x' * (1 << 20))\n")
    assert p.returncode == 1
    rec = json.loads((rank_dir / "exception.json").read_text())
    assert len(rec["message"]) == bootstrap.MESSAGE_LIMIT
    assert rec["problems"] == [f"message of {1 << 20} characters cut to {bootstrap.MESSAGE_LIMIT}"]
    assert (rank_dir / "exception.json").stat().st_size < 1_000_000


def test_a_failing_user_excepthook_does_not_lose_the_record(tmp_path):
    """The user's own hook (chained after ours) raises while it runs: Python prints 'Error in
    sys.excepthook' and the original exception; our record is already on disk."""
    p, rank_dir = _run(tmp_path, (
        "import sys\n"
        "def hook(t, v, tb):\n    raise OSError('log server gone')\n"
        "import elastic_diag.worker.bootstrap as b\nb._state['previous_excepthook'] = hook\n"
        "raise KeyError('shard-9')\n"
    ))  # fmt: skip
    assert p.returncode == 1 and "Error in sys.excepthook" in p.stderr
    rec = json.loads((rank_dir / "exception.json").read_text())
    assert rec["type"] == "KeyError" and rec["message"] == "'shard-9'"


def test_a_threads_uncaught_exception_is_recorded(tmp_path):
    p, rank_dir = _run(tmp_path, (
        "import threading\n"
        "def prefetch():\n    raise ValueError('corrupt shard 17')\n"
        "t = threading.Thread(target=prefetch, name='prefetch')\nt.start(); t.join()\n"
        "def other():\n    raise KeyError('second')\n"
        "t = threading.Thread(target=other); t.start(); t.join()\n"
    ))  # fmt: skip
    assert p.returncode == 0 and "Exception in thread prefetch" in p.stderr
    rec = json.loads((rank_dir / layout.THREAD_EXCEPTION_FILE).read_text())
    assert (rec["type"], rec["message"], rec["thread"]) == ("ValueError", "corrupt shard 17", "prefetch")
    assert not (rank_dir / layout.EXCEPTION_FILE).exists()
