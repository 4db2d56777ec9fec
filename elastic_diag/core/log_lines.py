"""Log formats: where a line comes from (rank, node, time) and torchrun's own failure summary.

Pure string handling, no torch, no I/O. Recognised:

* line prefixes, applied in any order: a pdsh/DeepSpeed host prefix (``worker-1: ``), torch's
  ``[rank3]:`` (uncaught tracebacks in torch 2.x) and torchrun's ``[default3]:`` (``--tee``, a
  LOCAL rank), glog headers of torch's C++ (``E1026 04:01:29.444000 139 ProcessGroupNCCL.cpp:616] ``),
  Python logging / DeepSpeed timestamps (``[2024-03-01 12:00:00,123] ``), raw NCCL lines
  (``host:pid:tid [dev] NCCL WARN``: ``[dev]`` is a CUDA device, never a rank);
* a rank named inside a message (``[Rank 3] Watchdog ...``) is left in the text: it may be local to a
  process group and is not the line's rank;
* the rank of a whole file from its path: elastic_diag's ``attempt_N/rank_R/``, torchrun's
  ``attempt_N/<local rank>/stderr.log``, Slurm ``%t`` outputs (``job.3.out``, ``slurm-77_3.out``),
  ``rank_3.log``, ``trainer-pod-2.log``;
* torchrun's failure summary (``ChildFailedError`` ... ``Root Cause (first observed failure)``).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from pathlib import PurePath

from elastic_diag.core.evidence import FingerprintReport, LogLine, WatchdogTimeout
from elastic_diag.core.taxonomy import Signature, Taxonomy
from elastic_diag.core.values import MAX_RANK, signal_name

# a run of more digits than any fact a log line tells (a 64-bit number has 19; ns timestamps 19): junk, shown as
# "<N digits>" so that no parser turns it into a number (Python refuses int() of 4,300 digits or more)
_LONG_DIGITS = re.compile(r"\d{21,}")
_HOST = re.compile(r"^(?P<host>[a-z0-9][a-z0-9.-]*\d[a-z0-9.-]*): ")
_RANK = re.compile(r"^\[(?P<kind>rank|default|[A-Za-z_]+?)(?P<rank>\d+|<\d+ digits>)\]:")
# glog of torch's C++: "E1026 04:01:29.444000 139 file.cpp:616] " (pid optional: newer torch writes
# "[E1213 17:24:49.082246429 file.cpp:2573] "), and the old "[E file.cpp:737] " without a date.
_GLOG = re.compile(
    r"^(?:(?P<level>[IWEF])(?P<month>\d\d)(?P<day>\d\d) (?P<time>\d\d:\d\d:\d\d(?:\.\d+)?)(?:\s+(?P<pid>\d+))?"
    r"|[IWEF]) (?P<where>[^\]\s]+:\d+)\] ?"
)
_NCCL = re.compile(
    r"^(?P<host>[\w.-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] (?:\S+:\d+ )?NCCL (?P<level>[A-Z]+) "
)
_STAMP = re.compile(
    r"^\[?(?P<date>\d{4}-\d\d-\d\d)[ T_](?P<time>\d\d:\d\d:\d\d)(?:[.,](?P<frac>\d+))?"
    r"(?P<zone>Z|[+-]\d\d:?\d\d)?\]?\s*"
)
# colour and cursor codes (CSI sequences and two-byte escapes)
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# Slurm's srun --label: "3: " before every line of task 3
_LABEL = re.compile(r"^(?P<task>\d{1,5}): ")
# a rank prefix after other output on the same line (a progress bar's frame, an unfinished line)
_GLUED_RANK = re.compile(r"\[(?:rank|default)\d+\]:")
# a Python logging record's level and location, e.g. OLMo's "CRITICAL [olmo.util:158, rank=0] " (global rank)
_PYLOG = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\[[\w./-]+:\d+(?:, rank=(?P<rank>\d+))?\]\s*")

_PATH_RANK = (
    re.compile(r"(?:^|/)rank_(?P<rank>\d+)/[^/]+$"),
    re.compile(r"(?:^|/)attempt_\d+/(?P<rank>\d+)/(?:stdout|stderr)\.log$|(?:^|/)attempt_\d+/(?P<r2>\d+)/error\.json$"),
    re.compile(r"(?:^|/)slurm-\d+[._](?P<rank>\d+)\.(?:out|err)$"),
    re.compile(r"(?:^|/)[^/]*?(?:rank|task|worker|pod|proc|process)[-_.]?(?P<rank>\d+)(?:\.[a-z]+)*$", re.IGNORECASE),
    re.compile(r"(?:^|/)[^/]+\.(?P<rank>\d+)\.(?:out|err|log)$"),
)


@dataclass(frozen=True, slots=True)
class ParsedLine:
    text: str  # the message with every recognised prefix removed
    rank: int | None = None
    local: bool = False  # the rank came from torchrun's [defaultN] (a local rank)
    host: str | None = None
    pid: int | None = None
    time: float | None = None  # epoch seconds where the prefix carries a full date
    clock: str | None = None  # "MMDD HH:MM:SS.ffffff" of glog lines (no year): orders lines of one run
    nccl_device: int | None = None


def parse_line(line: str, *, local_time: bool = False) -> ParsedLine:
    """The line's origin (rank, host, pid, time) and its message without the prefixes that told them.

    Colour codes are removed first; of a line a progress bar rewrote with ``\\r``, the last frame is
    read (what the terminal showed), and of a line with NUL bytes (a crashed writer's hole) what follows them;
    a run of more than 20 digits (junk) becomes ``<N digits>``, and a rank prefix no process can have is
    dropped without giving a rank; a rank prefix glued after other output (a tqdm frame without a
    newline: ``...27.1it/s][rank4]:[E524 ...] Watchdog ...``) still gives the line its rank. A timestamp
    with no zone is UTC, or this machine's zone with ``local_time`` (the live agent reads lines its own
    ranks wrote a moment ago)."""
    text = line.rstrip("\r\n")
    if "\x00" in text:  # a hole a crashed writer left (NUL bytes): the text after it is a line of its own
        text = next((seg for seg in reversed(text.split("\x00")) if seg.strip()), "")
    if _LONG_DIGITS.search(text):
        text = _LONG_DIGITS.sub(lambda m: f"<{len(m[0])} digits>", text)
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "\r" in text:
        text = next((seg for seg in reversed(text.split("\r")) if seg.strip()), "")
    parsed = _parse_prefixes(text, local_time)
    if parsed.rank is None and (m := _GLUED_RANK.search(parsed.text, 1)):
        glued = _parse_prefixes(parsed.text[m.start() :], local_time)
        parsed = ParsedLine(text=glued.text, rank=glued.rank, local=glued.local, host=parsed.host or glued.host,
                            pid=parsed.pid or glued.pid, time=parsed.time or glued.time,
                            clock=parsed.clock or glued.clock, nccl_device=glued.nccl_device)  # fmt: skip
    return parsed


def _parse_prefixes(text: str, local_time: bool) -> ParsedLine:
    rank = host = pid = time = clock = device = None
    local = False
    for _ in range(6):
        m = _LABEL.match(text)
        if m and rank is None and host is None:  # srun --label: "3: " is the task, the global rank
            rank, text = int(m["task"]), text[m.end() :]
            continue
        m = _HOST.match(text)
        if m and host is None:
            host, text = m["host"], text[m.end() :]
            continue
        m = _RANK.match(text)
        if m:
            is_local = m["kind"] != "rank"
            if not m["rank"].isdigit() or int(m["rank"]) > MAX_RANK:  # no process has that rank: junk, not a rank
                text = text[m.end() :]
                continue
            if rank is None or (local and not is_local):  # [default2]:[rank2]: -> the global [rankN] wins
                rank, local = int(m["rank"]), is_local
            text = text[m.end() :]
            continue
        if text.startswith("[") and (m := _GLOG.match(text[1:])):
            text = text[m.end() + 1 :]
        elif m := _GLOG.match(text):
            text = text[m.end() :]
        else:
            m = None
        if m:
            if m["pid"]:
                pid = int(m["pid"])
            if m["month"]:
                clock = f"{m['month']}{m['day']} {m['time']}"
            continue
        m = _NCCL.match(text)
        if m:
            host, pid, device = host or m["host"], int(m["pid"]), int(m["dev"])
            text = text[m.start("level") - 5 :]  # keep "NCCL WARN ..."
            break
        m = _PYLOG.match(text)
        if m:
            if m["rank"] and rank is None:
                rank = int(m["rank"])
            text = text[m.end() :]
            continue
        m = _STAMP.match(text)
        if m and time is None:
            time = _epoch(m, local_time)
            text = text[m.end() :]
            continue
        break
    return ParsedLine(text=text, rank=rank, local=local, host=host, pid=pid, time=time, clock=clock,
                      nccl_device=device)  # fmt: skip


def _epoch(m: re.Match[str], local_time: bool) -> float | None:
    """A timestamp prefix as epoch seconds: in the zone it names, else UTC (never the reader's local zone:
    the same logs give the same times on every machine)."""
    try:
        when = datetime.fromisoformat(f"{m['date']}T{m['time']}")
    except ValueError:
        return None
    zone = m["zone"]
    if zone is None and local_time:
        seconds = when.timestamp()  # naive: this machine's zone
        return seconds + float(f"0.{m['frac']}") if m["frac"] else seconds
    if zone and zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        hours, minutes = int(zone[1:3]), int(zone[-2:])
        tz = timezone(sign * timedelta(hours=hours, minutes=minutes))
    else:
        tz = UTC
    seconds = when.replace(tzinfo=tz).timestamp()
    return seconds + float(f"0.{m['frac']}") if m["frac"] else seconds


_MESSAGE_RANK = re.compile(
    r"^(?:what\(\):\s+)?(?:\[[EWIF] \S+\] )?"
    r"\[(?:Rank (?P<r1>\d+)|PG (?:ID )?0 (?:PG GUID 0(?:\(default_pg\))? )?Rank (?P<r2>\d+))\]"
)


def message_rank(text: str) -> int | None:
    """``[Rank 3] ...`` / ``[PG ID 0 PG GUID 0(default_pg) Rank 3] ...`` at the start of a message (or of a
    C++ exception's ``what():`` line): the rank in the DEFAULT group (= global). Other groups' ranks are
    local to them and not returned."""
    m = _MESSAGE_RANK.match(text)
    if not m:
        return None
    return int(m["r1"] or m["r2"])


def rank_from_path(path: str | PurePath) -> int | None:
    """The rank a whole file belongs to, from its path (a gzipped log's name without ``.gz``)."""
    p = str(path).replace("\\", "/").removesuffix(".gz")
    for pattern in _PATH_RANK:
        m = pattern.search(p)
        if m:
            value = m.groupdict().get("rank") or m.groupdict().get("r2")
            if value is not None:
                return int(value) if len(value) <= 10 and int(value) <= MAX_RANK else None
    return None


# --- torchrun's failure summary ------------------------------------------------------------------

_SUMMARY_START = "ChildFailedError"
_ROOT = "Root Cause (first observed failure):"
_FAILURES = "Failures:"  # the table's own start, when it is printed without ChildFailedError's line
_BLOCK = re.compile(r"^\s*\[(?P<idx>\d+)\]:\s*$")
_FIELD = re.compile(r"^\s*(?P<key>time|host|rank|exitcode|error_file|traceback)\s*:\s?(?P<value>.*)$")
_RANK_FIELD = re.compile(r"(?P<rank>\d+) \(local_rank: (?P<local>\d+)\)")
_EXIT_FIELD = re.compile(r"(?P<code>-?\d+) \(pid: (?P<pid>\d+)\)(?:\s+\((?P<sig>SIG\w+)\))?")
_FAILED_LINE = re.compile(r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<local>\d+) \(pid: (?P<pid>\d+)\)")


@dataclass(slots=True)
class SummaryFailure:
    """One ``[i]:`` block of torchrun's ChildFailedError summary."""

    rank: int | None = None
    local_rank: int | None = None
    exit_code: int | None = None
    pid: int | None = None
    host: str | None = None
    time: float | None = None
    error_file: str | None = None
    traceback: list[str] = field(default_factory=list)
    root: bool = False

    @property
    def signal(self) -> str | None:
        return signal_name(self.exit_code)


class SummaryParser:
    """Feed it every line (prefixes removed); it collects torchrun's failure blocks."""

    def __init__(self) -> None:
        self.failures: list[SummaryFailure] = []
        self._in_summary = False
        self._root_next = False
        self._current: SummaryFailure | None = None
        self._in_traceback = False

    @property
    def active(self) -> bool:
        """Inside a summary: every following line matters until it ends."""
        return self._in_summary

    def feed(self, text: str) -> None:
        if _SUMMARY_START in text or (not self._in_summary and text.strip() == _FAILURES):
            self._in_summary = True
            return
        if not self._in_summary:
            return
        if text.strip().startswith(_ROOT):
            self._root_next = True
            self._close()
            return
        if text.strip().startswith("====="):
            self._close()
            if self._root_next is False and self.failures and self.failures[-1].root:
                self._in_summary = False
            return
        m = _BLOCK.match(text)
        if m:
            self._close()
            self._current = SummaryFailure(root=self._root_next)
            self._root_next = False
            return
        cur = self._current
        if cur is None:
            return
        m = _FIELD.match(text)
        if m:
            self._in_traceback = False
            key, value = m["key"], m["value"].strip()
            if key == "rank" and (r := _RANK_FIELD.search(value)):
                cur.rank, cur.local_rank = int(r["rank"]), int(r["local"])
            elif key == "exitcode" and (e := _EXIT_FIELD.search(value)):
                cur.exit_code, cur.pid = int(e["code"]), int(e["pid"])
            elif key == "host":
                cur.host = value
            elif key == "time":
                with contextlib.suppress(ValueError):
                    cur.time = datetime.strptime(value, "%Y-%m-%d_%H:%M:%S").timestamp()
            elif key == "error_file":
                cur.error_file = value
            elif key == "traceback":
                self._in_traceback = True
                if value:
                    cur.traceback.append(value)
        elif self._in_traceback and text.strip() and not text.strip().startswith("-----"):
            cur.traceback.append(text.strip())

    def _close(self) -> None:
        if self._current is not None and (self._current.rank is not None or self._current.exit_code is not None):
            self.failures.append(self._current)
        self._current = None
        self._in_traceback = False

    def finish(self) -> list[SummaryFailure]:
        self._close()
        return self.failures

    @property
    def root(self) -> SummaryFailure | None:
        return next((f for f in self.failures if f.root), None)


def parse_failed_line(text: str) -> tuple[int, int, int] | None:
    """torch's ``failed (exitcode: 1) local_rank: 2 (pid: 3883) of binary`` line: (code, local, pid)."""
    m = _FAILED_LINE.search(text)
    return (int(m["code"]), int(m["local"]), int(m["pid"])) if m else None


# --- DeepSpeed launcher -----------------------------------------------------------------------------

_DS_MAPPING = re.compile(r"global_rank_mapping=(?:defaultdict\(<class 'list'>, )?(?P<map>\{.*\})")
# the command DeepSpeed prints is often wrapped over several lines in a paste: then only the code is known
_DS_EXIT = re.compile(r"(?:--local_rank=(?P<local>\d+)'.*)?\] exits with return code = (?P<code>-?\d+)")


# --- TORCH_DISTRIBUTED_DEBUG=DETAIL's fingerprint check ------------------------------------------------

_FP_ME = re.compile(r"Rank (?P<rank>\d+) is running (?:inconsistent )?collective: CollectiveFingerPrint\("
                    r"(?:SequenceNumber=(?P<seq>\d+),? ?)?OpType=(?P<op>\w+)")  # fmt: skip
_FP_OTHER = re.compile(r"but Rank (?P<rank>\d+) is running collective: CollectiveFingerPrint\("
                       r"(?:(?:SequenceNumber=(?P<seq>\d+),? ?)?OpType=(?P<op>\w+?)(?=[,)]))?")  # fmt: skip
_FP_SEQS = re.compile(r"Sequence number: (?P<mine>\d+) ?vs ?(?P<theirs>\d+)")
_FP_OPS = re.compile(r"Op type: (?P<mine>\w+?) ?vs (?P<theirs>\w+)")


def parse_fingerprint_report(text: str) -> FingerprintReport | None:
    me = _FP_ME.search(text)
    if not me:
        return None
    other = _FP_OTHER.search(text, me.end())
    seqs, ops = _FP_SEQS.search(text), _FP_OPS.search(text)

    def num(value: str | None) -> int | None:
        return int(value) if value is not None else None

    return FingerprintReport(
        rank=int(me["rank"]),
        seq=num(me["seq"]) if me["seq"] else num(seqs["mine"] if seqs else None),
        op=me["op"],
        other=int(other["rank"]) if other else None,
        other_seq=num(other["seq"] if other and other["seq"] else (seqs["theirs"] if seqs else None)),
        other_op=(other["op"] if other and other["op"] else (ops["theirs"] if ops else None)),
    )


# --- other launchers that name a global rank and its exit ------------------------------------------

# MosaicML Composer's launcher: "Rank 2 crashed with exit code -7." (the first it saw) and, for each rank
# that crashed (not those it stopped), "Global rank 2 (PID 4242) exited with code -7"
# Open MPI's mpirun: "mpirun noticed that process rank 3 with PID 4242 on node n1 exited on signal 9 (Killed)."
# (the first process it saw die; its rank is the MPI rank, the job's global rank); Horovod's gloo launcher
# (horovodrun): "Process 3 exit with status code 137." (a shell status: 128 + N is death by signal N)
_LAUNCHER_EXIT = re.compile(
    r"\bRank (?P<r1>\d+) crashed with exit code (?P<c1>-?\d+)"
    r"|\bGlobal rank (?P<r2>\d+) \(PID \d+\) exited with code (?P<c2>-?\d+)"
    r"|\bmpirun noticed that process rank (?P<r3>\d+) with PID \S+ on node \S+ exited on signal (?P<s3>\d+)"
    r"|^\s*Process (?P<r4>\d+) exit with status code (?P<c4>\d+)\.?\s*$"
)
LAUNCHER_EXIT_WORDS = ("xited with code", "crashed with", "exited on signal", "exit with status code")


def parse_launcher_exit(text: str) -> tuple[int, int, str] | None:
    """A launcher's line naming a GLOBAL rank and its exit status: (rank, code, launcher); a death by signal
    N is status -N, as torch's launchers give it."""
    m = _LAUNCHER_EXIT.search(text)
    if not m:
        return None
    if m["r1"]:
        return int(m["r1"]), int(m["c1"]), "composer"
    if m["r2"]:
        return int(m["r2"]), int(m["c2"]), "composer"
    if m["r3"]:
        return int(m["r3"]), -int(m["s3"]), "mpirun"
    code = int(m["c4"])
    return int(m["r4"]), -(code - 128) if 128 < code < 160 else code, "horovodrun"


def parse_deepspeed_mapping(text: str) -> dict[str, list[int]] | None:
    """``global_rank_mapping={'worker-0': [0, 1], ...}`` of DeepSpeed's launch.py."""
    m = _DS_MAPPING.search(text)
    if not m:
        return None
    out: dict[str, list[int]] = {}
    for host, ranks in re.findall(r"'([^']+)': \[([\d, ]*)\]", m["map"]):
        out[host] = [int(r) for r in ranks.replace(" ", "").split(",") if r]
    return out or None


def parse_deepspeed_exit(text: str) -> tuple[int | None, int] | None:
    """DeepSpeed's ``[... '--local_rank=3' ...] exits with return code = -9``: (local rank, code); the local
    rank None when the command was wrapped onto lines of its own."""
    m = _DS_EXIT.search(text)
    return (int(m["local"]) if m["local"] else None, int(m["code"])) if m else None


# --- the end of a run, read from its logs ----------------------------------------------------------
# Any of these in a log is evidence that something failed, whatever else the logs say: the offline
# verdict is then never "healthy" (at least "unknown", with the lines). Checked on the candidate lines.
_FAILURE_EVIDENCE = re.compile(
    r"Traceback \(most recent call last\)|\bexit ?code\s*[:=]?\s*-?[1-9]|exits with return code =? ?-?[1-9]"
    r"|Signal \d+ \(SIG[A-Z]+\) received|\bKilled\b|Segmentation fault|core dumped|Watchdog caught|\btimed out\b"
    r"|ChildFailedError|DistStoreError|RendezvousTimeoutError|Out Of Memory|oom-kill|out of memory|\bAborted\b"
    r"|returned non-zero exit status|^\s*(?:(?:Uncaught|Unhandled) )?(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception)(?::|$)"
)
# What a run that ended well prints last: torch's agent, DeepSpeed's launcher, HF Trainer, Lightning,
# elastic_diag's own report. Read from the end of each file.
_COMPLETION = re.compile(
    r"worker group successfully finished|Local worker group finished \(WorkerState\.SUCCEEDED\)"
    r"|torchelastic\.worker\.status\.SUCCEEDED"  # torch.distributed.launch's JSON events
    r"|exits successfully\.?$|Training completed\. Do not forget|`Trainer\.fit` stopped: `max_(?:epochs|steps)="
    r"|\bexit(?:ed)? with (?:exit )?(?:code|status) 0\b"
    r"|\*{5} train metrics \*{5}|'train_runtime': \d"  # HF Trainer's end-of-training metrics
    r"|\[after training is done\]"  # Megatron-LM
    r"|\"key\": \"run_stop\".*\"status\": \"success\"|ENDING TIMING RUN AT"  # MLPerf's logger and run scripts
    r"|Training completed after \d+ iterations|Job finished \(status: SUCCEEDED\)"  # Ray, SkyPilot
    r"|^\W*(?:job )?status: SUCCEEDED$|Job '[\w-]+' succeeded"  # a job's status (TorchX, Ray jobs)
    r"|(?i:\b(?:training|train) (?:is )?(?:finished|completed?|done)\b(?! iteration)(?!:)"
    r"|\b(?:finished|done) training\b)"
    # the process group's destructor at a normal interpreter exit (torch >= 2.4): the rank got to the end
    r"|destroy_process_group\(\) was not called before program exit"
)


def failure_evidence(text: str) -> bool:
    """The line shows a failure of some kind (an exception, a non-zero exit, a signal, a kill, a timeout)."""
    return _FAILURE_EVIDENCE.search(text) is not None


def completion_line(text: str) -> bool:
    """The line says the run (or this node's part of it) ended well."""
    return _COMPLETION.search(text) is not None


# --- the NCCL watchdog's own fields ---------------------------------------------------------------------
# the op must be followed by its comma or parenthesis: a line a terminal cut may end inside it
_WATCHDOG = re.compile(r"WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)(?:[,)]|$)(?: NumelIn=(?P<numel>\d+),)?")


def parse_watchdog_timeout(text: str) -> WatchdogTimeout | None:
    """``WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1024, ...)`` in a watchdog line: the collective."""
    m = _WATCHDOG.search(text)
    if m is None:
        return None
    return WatchdogTimeout(int(m["seq"]), m["op"], int(m["numel"]) if m["numel"] else None)


def evidence_line(
    text: str,
    *,
    time: float | None = None,
    order: int = 0,
    source: str | None = None,
    offset: int | None = None,
    clock: str | None = None,
    rank: int | None = None,
    signature: str | None = None,
) -> LogLine:
    """A line kept as evidence (its prefixes already taken off by :func:`parse_line`), with the fields a
    watchdog line or a DETAIL fingerprint report carries parsed out: every front-end builds its lines here."""
    return LogLine(
        text=text, time=time, order=order, source=source, offset=offset, clock=clock, rank=rank, signature=signature,
        watchdog=parse_watchdog_timeout(text) if "WorkNCCL(" in text else None,
        fingerprint=parse_fingerprint_report(text) if "CollectiveFingerPrint" in text else None,
    )  # fmt: skip


# an exception's last line: `module.SomeError: message`, also as an excepthook logs it (OLMo: "Uncaught
# OLMoThreadError: ...")
EXC_LINE = re.compile(
    r"^(?:(?:Uncaught|Unhandled) (?:exception:? )?)?"
    r"(?P<type>(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Interrupt|Exit))(?::\s?(?P<msg>.*))?$"
)
GENERIC_EXCEPTION = "python-exception"


def signatures_of(text: str, taxonomy: Taxonomy) -> list[Signature]:
    """The signatures a line (prefixes taken off) is evidence of: every match, the generic "SomethingError:
    message" only on a line that is an exception's last line."""
    found = [sig for sig, _m in taxonomy.match_line(text)]
    if any(sig.id == GENERIC_EXCEPTION for sig in found) and not EXC_LINE.match(text):
        found = [sig for sig in found if sig.id != GENERIC_EXCEPTION]
    return found


# what shows that a job ran on one node, so that a local rank is the global one: detectron2's and others'
# printed arguments, torchrun's flags or its agent's rendezvous block (one entry per local worker, each with
# the whole world's size: as many entries as the world has ranks)
_SINGLE_NODE = re.compile(
    r"\bnum_machines[=:]\s*1\b|\bnum_nodes[=:]\s*1\b|\bnnodes[=:]\s*1(?::1)?\b|--nnodes[= ]1(?::1)?\b|--standalone\b"
    r"|global_world_sizes=\[(?P<sizes>[\d, ]+)\]"
)


_SINGLE_NODE_WORDS = ("num_machines", "num_nodes", "nnodes", "--standalone", "global_world_sizes")


def single_node_line(text: str) -> str | None:
    """The line, cut, when it shows the job ran on one node; else None."""
    if not any(word in text for word in _SINGLE_NODE_WORDS):  # the pattern is slow (15 us a line): words first
        return None
    m = _SINGLE_NODE.search(text)
    if m is None:
        return None
    if m["sizes"] is not None:
        sizes = [int(v) for v in m["sizes"].replace(" ", "").split(",") if v]
        if not sizes or len(set(sizes)) != 1 or sizes[0] != len(sizes):
            return None
    return text[:300]
