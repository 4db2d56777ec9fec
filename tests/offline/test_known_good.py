"""``elastic-diag analyze FAILED --known-good GOOD``: the first line of each rank that differs from a good run.

Real runs of one user-style trainer (tests/offline/known_good_job.py: Python logging, a tqdm bar, a library
warning, a shard name and the loss every step) on 2 gloo ranks, each run with its own seed, step count, port,
pids and timestamps: two good runs (one under torchrun-diag, a diag dir; one under plain torchrun --tee 3, a
console log) and two failed ones where rank 1 first warns "checksum mismatch ... using cached copy" (plain
torchrun: it then raises; torchrun-diag: it then stalls past the collective timeout). Compared across the two
layouts, the planted warning is the first divergence and the runs' normal differences never are. Then the
bad input: a "good" run that failed, one of another script, an empty one; and written logs for what the runs
cannot show cheaply (no rule names a rank, a changed layout).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES, ROOT, kill_leftovers

from elastic_diag.core.templates import pre_templates, shape_key, template
from elastic_diag.offline.analyze import analyze_paths
from elastic_diag.offline.divergence import with_known_good
from elastic_diag.report.schema import validate

JOB = Path(__file__).with_name("known_good_job.py")
PLANTED = "checksum mismatch for shard-"
OTHER_SCRIPT = FIXTURES / "logs" / "329_healthy_deepspeed_2proc_exits_successfully_glued_progress" / "console.log"


def _run(argv: list[str], out: Path, diag_dir: Path | None, timeout: float = 90,
         env: dict[str, str] | None = None) -> int:  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with out.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"{argv} timed out:\n{out.read_text(errors='replace')[-3000:]}")
        finally:
            if diag_dir is not None:
                kill_leftovers(diag_dir)


class Runs:
    """The four runs, each made once for the session's xdist workers together (a lock per run in their shared temp
    root): two workers needing different runs make them side by side. The failed torchrun-diag run finds its good
    run in a ledger both keep, as one job."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(exist_ok=True)
        self.ledger = {"ELASTIC_DIAG_LEDGER": str(root / "ledger.sqlite"), "ELASTIC_DIAG_JOB_ID": "known-good-test"}

    def __getitem__(self, name: str) -> Path:
        from filelock import FileLock

        if name == "failed_diag_out":
            self["failed_diag"]
            return self.root / "failed_diag.out"
        path = self.root / (name + (".log" if name.endswith("console") else ""))
        with FileLock(str(self.root / f"{name}.lock")):
            if not (self.root / f"{name}.done").exists():
                self._make(name)
                (self.root / f"{name}.done").write_text("")
        return path

    def _make(self, name: str) -> None:
        d = self.root
        diag = [sys.executable, "-m", "elastic_diag.run", "--standalone", "--nproc-per-node", "2"]
        plain = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--tee", "3"]
        job = [str(JOB), "--culprit", "1", "--fail-at", "4", "--pg-timeout", "4"]
        if name == "good_diag":
            code = _run([*diag, "--diag-dir", str(d / name), *job, "--seed", "1", "--steps", "9"], d / f"{name}.out",
                        d / name, env=self.ledger)  # fmt: skip
        elif name == "good_console":
            code = _run([*plain, *job, "--seed", "3", "--steps", "11"], d / f"{name}.log", None)
        elif name == "failed_console":
            code = _run([*plain, *job, "--seed", "2", "--steps", "12", "--fail", "raise"], d / f"{name}.log", None)
        else:
            self["good_diag"]  # in the ledger first: the failed run looks for it there
            code = _run([*diag, "--diag-dir", str(d / name), *job, "--seed", "4", "--steps", "10", "--fail", "stall"],
                        d / f"{name}.out", d / name, env=self.ledger)  # fmt: skip
        assert code == (0 if name.startswith("good") else 1), (name, code)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.getbasetemp().parent / "known_good_runs")


def _compare(failed: Path, good: Path, insist: bool = False) -> dict:
    analysis = with_known_good(analyze_paths([failed]), [failed], [good], insist=insist)
    data = analysis.to_json()
    validate(data)
    return data


def _line(path: str, number: int) -> str:
    return Path(path).read_text(errors="replace").split("\n")[number - 1]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("failed", "good"), [("failed_console", "good_diag"), ("failed_diag", "good_console")])
def test_the_planted_warning_is_the_first_divergence_across_layouts(runs, failed, good):
    data = _compare(runs[failed], runs[good])
    assert data["diagnosis"]["initiating_rank"] == 1, data["diagnosis"]
    assert data["known_good"]["runs"] == {"failed": [str(runs[failed])], "good": [str(runs[good])]}
    first = data["first_divergence"][0]
    assert (first["rank"], first["level"], first["ranks_printing"]) == (1, "warning", 1), data["first_divergence"]
    assert PLANTED in first["text"] and first["before_error"] is True
    assert PLANTED in _line(first["file"], first["line"])  # the line number is the file's
    # the runs' normal differences (seeds, steps, ports, pids, times, losses, the bar) are never a divergence:
    # every rank's row is the planted line (rows of no rank are the launchers' own lines, one layout has none)
    ranked = [r for r in data["first_divergence"] if r["rank"] is not None]
    assert [r["rank"] for r in ranked] == [1] and all(PLANTED in r["text"] for r in ranked), ranked
    assert not data["known_good"]["notes"] or all("another script" not in n for n in data["known_good"]["notes"])


@pytest.mark.multiprocess
def test_two_good_runs_of_different_seeds_and_layouts_do_not_diverge(runs):
    data = _compare(runs["good_console"], runs["good_diag"])
    assert data["diagnosis"]["failure_class"] in ("healthy", "unknown")  # plain torchrun prints no "done" line
    assert [r for r in data["first_divergence"] if r["rank"] is not None] == []


@pytest.mark.multiprocess
def test_the_command_line_and_its_text(runs):
    argv = [sys.executable, "-m", "elastic_diag", "analyze", str(runs["failed_console"]), "--known-good",
            str(runs["good_diag"])]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "first divergence from the known-good run" in done.stdout
    assert "rank 1 [warning; only this rank" in done.stdout, done.stdout
    assert runs["failed_console"].name in done.stdout


@pytest.mark.multiprocess
def test_a_good_run_that_failed_is_refused_unless_asked(runs):
    refused = _compare(runs["failed_diag"], runs["failed_console"])
    assert refused["known_good"]["refused"].startswith("the known-good run is itself a failure (python_exception")
    assert refused["first_divergence"] == [] and refused["diagnosis"]["initiating_rank"] == 1
    insisted = _compare(runs["failed_diag"], runs["failed_console"], insist=True)
    assert "compared all the same" in insisted["known_good"]["notes"][0]
    assert PLANTED not in json.dumps(insisted["first_divergence"])  # both runs printed it: not novel


@pytest.mark.multiprocess
def test_another_script_and_an_empty_good_run_are_said_and_the_verdict_stands(runs, tmp_path):
    other = _compare(runs["failed_console"], OTHER_SCRIPT)
    assert any("looks like another script" in n for n in other["known_good"]["notes"]), other["known_good"]
    assert other["diagnosis"]["initiating_rank"] == 1
    empty = tmp_path / "empty.log"
    empty.write_text("")
    data = _compare(runs["failed_console"], empty)
    assert any("no readable line" in n for n in data["known_good"]["notes"])
    assert data["diagnosis"]["initiating_rank"] == 1 and data["first_divergence"] == []
    missing = _compare(runs["failed_console"], tmp_path / "nothing-here")
    assert any("no such file" in n for n in missing["known_good"]["notes"]), missing["known_good"]


# --- live: torchrun-diag compares after its verdict ------------------------------------------------------


@pytest.mark.multiprocess
def test_torchrun_diag_compares_with_the_last_good_run_of_the_job_from_the_ledger(runs):
    report = json.loads((runs["failed_diag"] / "report.json").read_text())
    validate(report)
    kg, first = report["known_good"], report["first_divergence"][0]
    assert kg["found"] == "the last successful run of job known-good-test (ledger)", kg
    assert kg["runs"]["good"] == [str(runs["good_diag"])]
    assert (first["rank"], first["level"]) == (1, "warning") and PLANTED in first["text"], report["first_divergence"]
    assert first["seconds_before_error"] is not None and first["seconds_before_error"] > 0
    said = runs["failed_diag_out"].read_text(errors="replace")
    assert "torchrun-diag: compared with the known-good run" in said and "rank 1 [warning; only this rank" in said
    # printed after the verdict: the summary comes first
    assert said.index("elastic_diag: job FAILED") < said.index("compared with the known-good run"), said[-3000:]
    page = (runs["failed_diag"] / "report.html").read_text()
    assert 'id="known-good"' in page and "checksum mismatch for shard-" in page


@pytest.mark.multiprocess
def test_the_given_good_run_is_compared_and_merged_into_the_report(runs, tmp_path):
    from elastic_diag.launch.known_good import compare_after_verdict

    diag = tmp_path / "failed"
    shutil.copytree(runs["failed_diag"], diag)
    report = json.loads((diag / "report.json").read_text())
    lines = compare_after_verdict(report, diag, str(runs["good_console"]), None)
    assert lines[0] == f"compared with the known-good run {runs['good_console']} (given):", lines
    merged = json.loads((diag / "report.json").read_text())
    validate(merged)
    assert merged["known_good"]["runs"]["good"] == [str(runs["good_console"])]
    assert PLANTED in merged["first_divergence"][0]["text"]
    gone = compare_after_verdict(report, diag, str(tmp_path / "no-such-run"), None)
    assert gone and "no such file" in " ".join(gone), gone
    assert compare_after_verdict({"status": "succeeded"}, diag, str(runs["good_console"]), None) == []


def test_a_verification_fails_when_the_divergent_line_is_printed_again(tmp_path):
    from elastic_diag.gate.rerun import divergence_seen_again

    raw = "2026-12-04 15:54:13,449 WARNING trainer: checksum mismatch for shard-83792.tar (expected ce89d36c), using"
    report = {"first_divergence": [{"rank": 1, "text": raw[24:], "raw": raw}]}
    again = tmp_path / "again.log"
    again.write_text("[default1]:2026-12-05 01:02:03,000 WARNING trainer: checksum mismatch for shard-00001.tar "
                     "(expected 0badf00d), using\n")  # fmt: skip
    clean = tmp_path / "clean.log"
    clean.write_text("[default1]:2026-12-05 01:02:03,000 INFO trainer: step 3 loss 0.2\n" * 1000)
    assert divergence_seen_again(report, [clean, again], None)["seen"] is True
    assert divergence_seen_again(report, [clean], None)["seen"] is False
    assert divergence_seen_again({}, [again], None) is None


# --- written logs: what the runs cannot show cheaply -------------------------------------------------------


def _write_run(folder: Path, ranks: int, seed: int, *, warn_rank: int | None, timeout: bool) -> None:
    import random
    import time

    rng = random.Random(seed)
    folder.mkdir(parents=True)
    for r in range(ranks):
        lines = [f"gpu-{seed}{r // 4}:{rng.randrange(9999)}:{rng.randrange(9999)} [{r % 4}] NCCL INFO Channel 00/02 : "
                 f"{r}[{r % 4}] -> {(r + 1) % ranks}[{(r + 1) % 4}] via P2P/IPC"]  # fmt: skip
        t = 1_796_000_000 + seed * 1000.0
        for step in range(120):
            t += 0.5
            ts = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
            lines.append(f"{ts},{rng.randrange(1000):03d} INFO step {step} loss {rng.random() * 3:.4f}")
            if r == warn_rank and step == 90:
                lines.append(f"{ts},000 WARNING falling back to CPU decode for batch {rng.randrange(9999)}: no nvjpeg")
        if timeout:
            lines.append(f"[rank{r}]:[E1204 15:21:44.{rng.randrange(10**6):06d} {1000 + r} ProcessGroupNCCL.cpp:616] "
                         f"[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=412, "
                         "OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for 600031 "
                         "milliseconds before timing out.")  # fmt: skip
        (folder / f"rank_{r}.log").write_text("\n".join(lines) + "\n")


def test_when_no_rule_names_a_rank_a_divergence_on_one_rank_makes_it_the_suspect(tmp_path):
    _write_run(tmp_path / "good", 4, 1, warn_rank=None, timeout=False)
    _write_run(tmp_path / "failed", 4, 2, warn_rank=2, timeout=True)
    data = _compare(tmp_path / "failed", tmp_path / "good")
    d = data["diagnosis"]
    assert d["initiating_rank"] is None and d["suspected_rank"] == 2, d  # every rank timed out alike
    assert "diverges from the known-good run before any error" in d["suspected_reason"]
    assert "Suspect: rank 2" in d["summary"] and data["known_good"]["suspect"]["rank"] == 2
    # the same line on every rank is no suspect
    _write_run(tmp_path / "failed_all", 4, 3, warn_rank=None, timeout=True)
    for r in range(4):
        with (tmp_path / "failed_all" / f"rank_{r}.log").open("r+") as fh:
            text = fh.read()
            fh.seek(0)
            fh.write(
                text.replace(" INFO step 60 ", " WARNING falling back to CPU decode: no nvjpeg\n0 INFO step 60 ", 1)
            )
    every = _compare(tmp_path / "failed_all", tmp_path / "good")
    assert every["diagnosis"].get("suspected_rank") is None
    assert {r["ranks_printing"] for r in every["first_divergence"] if r["rank"] is not None} == {4}


def test_a_good_run_with_fewer_ranks_and_other_hosts_is_compared_and_the_change_said(tmp_path):
    _write_run(tmp_path / "good", 4, 1, warn_rank=None, timeout=False)
    _write_run(tmp_path / "failed", 8, 2, warn_rank=6, timeout=True)
    data = _compare(tmp_path / "failed", tmp_path / "good")
    layout = data["known_good"]["layout"]
    assert layout["changed"] and "8 ranks against 4 in the good run" in layout["changes"][0], layout
    first = data["first_divergence"][0]
    assert first["rank"] == 6 and "falling back to CPU decode" in first["text"]  # ranks 4-7 compared by role
    assert [r["rank"] for r in data["first_divergence"] if r["rank"] is not None] == [6]


# --- public log pairs: a reporter's working and failing runs of one job ----------------------------------


@pytest.mark.parametrize("case", sorted(p.name for p in (FIXTURES / "known_good").iterdir()))
def test_a_public_pair_diverges_where_a_person_points(case):
    folder = FIXTURES / "known_good" / case
    expected = json.loads((folder / "expected.json").read_text())
    assert expected["source"].startswith("https://")
    data = _compare(folder / "failed.log", folder / "good.log")
    first = data["first_divergence"][0]
    assert expected["divergent_text"] in first["text"] and first["rank"] == expected["divergent_rank"], (
        data["first_divergence"])  # fmt: skip
    assert first["level"] in ("warning", "error")


# --- templates ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pair",
    [
        (b"[default3]:2026-12-04 15:21:44,123 INFO step 1234/100000 loss 2.3456 lr 1.2e-05",
         b"[default12]:2026-11-30 01:02:03,9 INFO step 5/100000 loss 12.1 lr 0.00012"),
        (b"gpu-a12:12345:12399 [3] NCCL INFO Channel 03/0 : 3[3] -> 4[4] via P2P/IPC/read",
         b"node7:1:2 [0] NCCL INFO Channel 13/0 : 13[5] -> 14[6] via P2P/IPC/read"),
        (b"Epoch 3:  45%|\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x8c     | 450/1000 [00:12<00:15, "
         b"36.52it/s, loss=2.35, v_num=0]",
         b"Epoch 0:   0%|          | 0/15 [00:00<?, ?it/s]"),
        (b"saved to /tmp/tmpk3j_x9zq/ckpt.pt", b"saved to /tmp/tmp0a1b2c3d/ckpt.pt"),
        (b"[rank3]:comm 0x55d5c8a3e2b0 rank 3 nranks 8 busId 5f000 commId 0x2a6c3b1c7b1f8e5c - Init COMPLETE",
         b"[rank0]:comm 0x7f0000001000 rank 0 nranks 16 busId 1a000 commId 0x0000aaaa0000bbbb - Init COMPLETE"),
        (b"3: step 5 \x1b[32mok\x1b[0m", b"[1,12]<stderr>:step 77 \x1b[32mok\x1b[0m"),
    ],
)  # fmt: skip
def test_normal_differences_share_a_template(pair):
    a, b = (template(pre_templates(x)[0]) for x in pair)
    assert a == b, (a, b)


@pytest.mark.parametrize(
    "pair",
    [
        (b"INFO step 5 loss 2.31", b"INFO step 5 loss nan"),
        (b"INFO using NCCL NET/IB", b"INFO using NCCL NET/Socket"),
        (b"loaded shard from remote store", b"checksum mismatch, using cached copy"),
        (b"WARNING: retrying in 5s", b"INFO: retrying in 5s"),
    ],
)
def test_what_matters_keeps_templates_apart(pair):
    a, b = (template(pre_templates(x)[0]) for x in pair)
    assert a != b


def test_a_line_keeps_its_length_and_its_last_progress_frame_is_its_shape():
    chunk = b"a 1\rb 22\nc 333\n"
    pre = pre_templates(chunk)
    assert [len(p) for p in pre] == [8, 5, 0]  # split at LF only, one byte for one byte: offsets stay true
    assert template(pre[0]) == template(pre_templates(b"b 7")[0])  # the frame the terminal showed last
    assert shape_key(pre_templates(b"step 12345 loss 0.25")[0]) == shape_key(pre_templates(b"step 7 loss 1.5")[0])


def test_a_log_of_garbage_on_either_side_is_bounded_and_said(tmp_path):
    import base64
    import random
    import time

    rng = random.Random(5)
    garbage = tmp_path / "garbage.log"
    garbage.write_bytes(b"\n".join(base64.b64encode(rng.randbytes(60)) for _ in range(120_000)) + b"\n")
    _write_run(tmp_path / "good", 2, 1, warn_rank=None, timeout=False)
    started = time.monotonic()
    as_failed = _compare(garbage, tmp_path / "good")
    as_good = _compare(tmp_path / "good", garbage)
    assert time.monotonic() - started < 60
    assert any("novel line shapes" in n for n in as_failed["known_good"]["notes"]), as_failed["known_good"]
    assert any("distinct line shapes" in n for n in as_good["known_good"]["notes"]), as_good["known_good"]
    assert len(as_failed["first_divergence"]) <= 64
