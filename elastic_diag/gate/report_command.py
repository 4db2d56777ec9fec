"""A report's verification command is data, not a script: what ``elastic-diag verify`` will run of it.

A report.json may come from someone else's run, or may have been edited, so its command is read, never
handed to a shell. It is split into words here (POSIX quoting, as ``shlex`` does) and read as the one
shape elastic_diag itself writes (core/verification.py, launch/relaunch.py)::

    [cd DIR &&] [NAME=VALUE ...] PROGRAM ARGS [&& [NAME=VALUE ...] PROGRAM ARGS ...]  [# comment]

``&&`` is the one operator understood: :func:`read_command` returns the steps and ``gate/rerun.py``
runs them itself, in order, each with ``shell=False``, stopping at the first that fails (as a shell
would). Everything else a shell would act on (``;``, ``|``, ``||``, ``&``, redirections, ``$VAR``,
``$(...)``, backticks, globs, ``~``, a newline) is a reason to refuse. A step runs only when

* its program (the basename of its first word) is on :data:`PROGRAMS`, the documented allow-list of
  diagnostic programs and of the launchers a relaunch re-runs the job with; a program that can change
  the machine (``nvidia-smi``, ``dcgmi``, ``ethtool``, ``curl``) only in its read-only forms;
* a ``python`` step is ``python -m`` one of :data:`PYTHON_MODULES` (the launchers elastic_diag writes
  a relaunch with) or ``python -c CODE`` where CODE is, verbatim, one of elastic_diag's own checks (the
  taxonomy's verification templates and the restart gate's built-in controls): any other code, a
  script, or an option before ``-c``/``-m`` is refused;
* its ``NAME=VALUE`` settings name only :data:`ENV_NAMES` (debug switches and elastic_diag's own
  settings: never ``LD_PRELOAD``, ``PYTHONPATH``, a plugin path);
* a launcher step has no ``--no-python`` (it would run any program as the job), and carries the job's
  restart-gate commands (``--diag-verify``, ``ELASTIC_DIAG_VERIFY``: they run with ``bash -c``) only
  with ``--max-restarts 0`` (or none), where the gate never runs them.

``cd DIR`` may only be the first step (it sets where the others run). The allow-list limits which
programs run, not what a relaunch's script does: a launcher step runs the script the report names,
which is why ``verify`` shows the command and where it comes from and asks first. With
``--allow-any-command`` the reasons are shown and not enforced, and still no shell runs: shell syntax
reaches the program as plain words.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import PurePosixPath

from elastic_diag import config as settings
from elastic_diag.layout import ENV_BEACON, ENV_SWITCH

# what a step may set in its environment: switches that make a failure say more, and elastic_diag's own
# settings (a relaunch under plain torchrun carries them). Not a loader path, not a plugin.
ENV_NAMES = frozenset({
    "CUDA_LAUNCH_BLOCKING", "PYTHONFAULTHANDLER", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_CPP_LOG_LEVEL",
    "TORCH_SHOW_CPP_STACKTRACES", "OMP_NUM_THREADS", ENV_SWITCH, ENV_BEACON,
    *(getattr(settings, name) for name in dir(settings) if name.startswith("ENV_")),
})  # fmt: skip
# ``python -m`` these: the launchers a relaunch is written with (launch/relaunch.py's _program)
PYTHON_MODULES = frozenset({"elastic_diag", "elastic_diag.run", "elastic_diag.cli", "torch.distributed.run"})
LAUNCHERS = frozenset({"torchrun", "torchrun-diag", "accelerate", "elastic-diag", "srun", "mpirun", "mpiexec",
                       *PYTHON_MODULES})  # fmt: skip
_PYTHON = re.compile(r"python(?:\d+(?:\.\d+)?)?")
_ENV_WORD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)
_OPERATOR_CHARS = ";&|<>()"
_NUMBER = re.compile(r"\d+(?:\.\d+)?")

ArgRule = Callable[[Sequence[str]], "str | None"]  # the step's arguments -> why not, or None


def _any_args(args: Sequence[str]) -> str | None:
    return None


def _only(allowed: frozenset[str], *, values_after: frozenset[str] = frozenset(),
          prefixes: tuple[str, ...] = (), what: str) -> ArgRule:  # fmt: skip
    """Arguments from ``allowed`` (and a value after each of ``values_after``; ``--opt=...`` of ``prefixes``)."""

    def rule(args: Sequence[str]) -> str | None:
        expect_value = False
        for arg in args:
            if expect_value:
                expect_value = False
                continue
            if arg in values_after:
                expect_value = True
            elif arg not in allowed and not arg.startswith(prefixes):
                return f"{arg!r} is not one of its {what} forms"
        return None

    return rule


_nvidia_smi = _only(
    frozenset({"-q", "--query", "-L", "--list-gpus", "-x", "--xml-format", "topo", "-m", "--matrix", "nvlink", "-s",
               "--status", "-B", "--list-excluded-gpus"}),
    values_after=frozenset({"-i", "--id", "-d", "--display"}),
    prefixes=("--query-gpu=", "--query-compute-apps=", "--format=", "--id=", "--display="),
    what="read-only (query)",
)  # fmt: skip
_ethtool = _only(
    frozenset({"-i", "--driver", "-S", "--statistics", "-k", "--show-features", "-g", "--show-ring", "-a",
               "--show-pause", "-c", "--show-coalesce", "-l", "--show-channels", "-m", "--module-info", "-P",
               "--show-permaddr", "-T", "--show-time-stamping"}),
    what="read-only (show)",
)  # fmt: skip


def _ethtool_rule(args: Sequence[str]) -> str | None:
    options = [a for a in args if a.startswith("-")]
    if why := _ethtool(options):
        return why
    return "more than one interface (a setting?)" if len(args) - len(options) > 1 else None


def _dcgmi(args: Sequence[str]) -> str | None:
    if args[:1] == ["diag"]:
        return _only(frozenset({"-j", "--json"}), values_after=frozenset({"-r", "--run"}), what="diag")(args[1:])
    if args[:1] == ["discovery"]:
        return _only(frozenset({"-l", "--list", "-c", "--compute-instances"}), what="discovery")(args[1:])
    return "only `dcgmi diag` and `dcgmi discovery` (the others can change the GPUs' settings)"


def _curl(args: Sequence[str]) -> str | None:
    """A probe of one http(s) address with its output thrown away: ``curl -sSf -o /dev/null URL``."""
    urls: list[str] = []
    expect: str | None = None  # the option whose value comes next
    for arg in args:
        if expect in ("-o", "--output"):
            if arg != "/dev/null":
                return "its output may only go to /dev/null"
            expect = None
        elif expect is not None:
            if not _NUMBER.fullmatch(arg):
                return f"{expect} takes a number of seconds"
            expect = None
        elif arg in ("-o", "--output", "-m", "--max-time", "--connect-timeout"):
            expect = arg
        elif arg.startswith("-") and not arg.startswith("--") and set(arg[1:]) <= set("sSfILv"):
            continue
        elif arg.startswith("-") and arg not in ("--silent", "--show-error", "--fail", "--head", "--location"):
            return f"{arg!r} is not one of its probe options"
        elif not arg.startswith("-"):
            urls.append(arg)
    if expect is not None:
        return f"{expect} needs a value"
    if len(urls) != 1 or not urls[0].startswith(("http://", "https://")):
        return "only a probe of one http(s) address (curl -sSf -o /dev/null URL)"
    return None


def _launcher(args: Sequence[str]) -> str | None:
    for arg in args:
        if arg.partition("=")[0] in ("--no-python", "--no_python"):
            return f"{arg!r} would run any program as the job"
    return None


def _accelerate(args: Sequence[str]) -> str | None:
    return _launcher(args) if args[:1] == ["launch"] else "only `accelerate launch` (a relaunch of the job)"


def _elastic_diag(args: Sequence[str]) -> str | None:
    if args[:1] and args[0] in ("run", "analyze", "report", "signatures", "explain"):
        return _launcher(args)
    if args[:1] == ["exec"]:
        return _exec(args[1:])
    return "only its run, exec, analyze, report, signatures and explain commands"


def _exec(args: Sequence[str]) -> str | None:
    """``elastic-diag exec [OPTIONS] -- python ...``: a relaunch of a job srun, mpirun or a parent script
    started, whose ranks are Python (as torchrun's relaunch runs a Python script, never another program)."""
    if "--" not in args:
        return "exec without `-- COMMAND`"
    command = list(args)[list(args).index("--") + 1 :]
    if not command or not _PYTHON.fullmatch(program_name(command[0])):
        return "exec of a command that is not a Python interpreter"
    return None


def _parallel(args: Sequence[str]) -> str | None:
    """``srun`` / ``mpirun`` / ``mpiexec`` only as the relaunch of a job watched by ``elastic-diag exec``:
    ``srun [OPTIONS] elastic-diag exec [OPTIONS] -- python ...`` (or ``python -m elastic_diag.cli exec``)."""
    for i, arg in enumerate(args):
        if program_name(arg) == "elastic-diag" and args[i + 1 : i + 2] == ["exec"]:
            return _exec(args[i + 2 :])
        if _PYTHON.fullmatch(program_name(arg)) and list(args[i + 1 : i + 4]) in (
            ["-m", "elastic_diag.cli", "exec"], ["-m", "elastic_diag", "exec"]):  # fmt: skip
            return _exec(args[i + 4 :])
    return "only a relaunch under elastic-diag exec (srun/mpirun ... elastic-diag exec -- python ...)"


# the allow-list: program (argv[0]'s basename) -> the rule for its arguments. docs/report.md lists it.
PROGRAMS: dict[str, ArgRule] = {
    "nvidia-smi": _nvidia_smi,
    "dcgmi": _dcgmi,
    "ibstat": _any_args,
    "ibstatus": _any_args,
    "ibv_devinfo": _any_args,
    "ibv_devices": _any_args,
    "ethtool": _ethtool_rule,
    "ping": _any_args,
    "df": _any_args,
    "free": _any_args,
    "nproc": _any_args,
    "lscpu": _any_args,
    "lspci": _any_args,
    "uptime": _any_args,
    "all_reduce_perf": _any_args,  # nccl-tests, named by the taxonomy to check the fabric alone
    "curl": _curl,
    "torchrun": _launcher,
    "torchrun-diag": _launcher,
    "accelerate": _accelerate,
    "elastic-diag": _elastic_diag,
    "srun": _parallel,
    "mpirun": _parallel,
    "mpiexec": _parallel,
}


@dataclass(frozen=True, slots=True)
class Step:
    """One program to run: its words, and the settings put before it (``NAME=VALUE``)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ReportCommand:
    """A command as :func:`read_command` read it: the steps to run and, when not empty, why not to."""

    text: str
    steps: tuple[Step, ...]
    cwd: str | None = None  # from a leading ``cd DIR &&``
    refusals: tuple[str, ...] = ()
    comment: str = ""
    unreadable: str | None = field(default=None)  # cannot be split into words at all: never runs

    @property
    def allowed(self) -> bool:
        return not self.refusals and self.unreadable is None


class _Lexer:
    """POSIX words and operators of a command line, with what a shell would have expanded noted."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str]] = []  # ("word" | "op", text)
        self.shell_syntax: list[str] = []
        self.comment = ""
        self.error: str | None = None

    def _note(self, what: str) -> None:
        if what not in self.shell_syntax:
            self.shell_syntax.append(what)

    def run(self) -> _Lexer:
        text, i, n = self.text, 0, len(self.text)
        word: list[str] | None = None
        while i < n:
            c = text[i]
            if c in " \t":
                if word is not None:
                    self.tokens.append(("word", "".join(word)))
                    word = None
                i += 1
            elif c == "\n" or c == "\r":
                self._note("a line break (a second command)")
                if word is not None:
                    self.tokens.append(("word", "".join(word)))
                    word = None
                self.tokens.append(("op", "\n"))
                i += 1
            elif c == "#" and word is None:
                self.comment = text[i + 1 :].strip()
                break
            elif c in _OPERATOR_CHARS:
                if word is not None:
                    self.tokens.append(("word", "".join(word)))
                    word = None
                j = i
                while j < n and text[j] in _OPERATOR_CHARS:
                    j += 1
                self.tokens.append(("op", text[i:j]))
                i = j
            elif c == "'":
                end = text.find("'", i + 1)
                if end < 0:
                    self.error = "a single quote is not closed"
                    return self
                word = (word or []) + [text[i + 1 : end]]
                i = end + 1
            elif c == '"':
                i, part = self._double(i + 1)
                if part is None:
                    return self
                word = (word or []) + [part]
            elif c == "\\":
                if i + 1 < n and text[i + 1] != "\n":
                    word = (word or []) + [text[i + 1]]
                i += 2
            else:
                if c in "$`":
                    self._note("`$(...)` or backticks (command substitution)" if c == "`" or text[i:i + 2] == "$("
                               else "`$` (a variable a shell would expand)")  # fmt: skip
                elif c in "*?[":
                    self._note("a glob pattern (`*`, `?`, `[`)")
                elif c == "~" and word is None:
                    self._note("`~` (a home folder a shell would expand)")
                word = (word or []) + [c]
                i += 1
        if word is not None:
            self.tokens.append(("word", "".join(word)))
        return self

    def _double(self, i: int) -> tuple[int, str | None]:
        """The inside of a double-quoted string from ``i``; (the index after it, its text)."""
        out: list[str] = []
        text, n = self.text, len(self.text)
        while i < n and text[i] != '"':
            c = text[i]
            if c == "\\" and i + 1 < n and text[i + 1] in '$`"\\\n':
                out.append(text[i + 1])
                i += 2
                continue
            if c in "$`":
                self._note("`$`, `$(...)` or backticks inside double quotes (a shell would expand them)")
            out.append(c)
            i += 1
        if i >= n:
            self.error = "a double quote is not closed"
            return i, None
        return i + 1, "".join(out)


def read_command(text: str) -> ReportCommand:
    """The steps of a report's command and every reason not to run it (see the module's doc)."""
    lexer = _Lexer(text).run()
    if lexer.error is not None:
        return ReportCommand(text, (), unreadable=f"it cannot be split into words: {lexer.error}")
    refusals = [f"shell syntax: {what}" for what in lexer.shell_syntax]
    groups: list[list[str]] = [[]]
    for kind, token in lexer.tokens:
        if kind == "op" and token == "&&":
            groups.append([])
        elif kind == "op":
            if token != "\n":
                refusals.append(f"shell syntax: {token!r} (a shell operator: pipe, list, background or redirection)")
            groups[-1].append(token)  # with --allow-any-command it is a plain word; no shell reads it
        else:
            groups[-1].append(token)
    if any(not g for g in groups):
        return ReportCommand(text, (), unreadable="it has an empty step (nothing before or after `&&`)",
                             comment=lexer.comment)  # fmt: skip
    cwd = None
    if groups[0][0] == "cd" and len(groups) > 1:
        if len(groups[0]) != 2:
            refusals.append("`cd` takes one folder")
        cwd = groups[0][1] if len(groups[0]) > 1 else None
        groups = groups[1:]
    steps = []
    for words in groups:
        env: list[tuple[str, str]] = []
        while words and (m := _ENV_WORD.fullmatch(words[0])) and len(words) > 1:
            env.append((m.group(1), m.group(2)))
            if m.group(1) not in ENV_NAMES:
                refusals.append(f"setting {m.group(1)} is not allowed (allowed: debug switches and ELASTIC_DIAG_*)")
            words = words[1:]
        step = Step(tuple(words), tuple(env))
        refusals.extend(_step_refusals(step))
        steps.append(step)
    return ReportCommand(text, tuple(steps), cwd=cwd, refusals=tuple(dict.fromkeys(refusals)),
                         comment=lexer.comment)  # fmt: skip


def program_name(argv0: str) -> str:
    return PurePosixPath(argv0).name


def _step_refusals(step: Step) -> list[str]:
    program, args = program_name(step.argv[0]), list(step.argv[1:])
    if program == "cd":
        return ["`cd` is only allowed as the first step (`cd DIR && ...`)"]
    if _PYTHON.fullmatch(program):
        why = _python_refusal(args)
        launcher = args[:1] == ["-m"]
    elif program in PROGRAMS:
        why = PROGRAMS[program](args)
        launcher = program in LAUNCHERS
    else:
        return [f"{program!r} is not on the allow-list of diagnostic programs"]
    if why is None and launcher:
        why = _gate_stays_shut(args, [name for name, _ in step.env])
    return [f"{program}: {why}"] if why else []


def _gate_stays_shut(args: Sequence[str], env_names: Sequence[str]) -> str | None:
    """A relaunch may carry the job's restart-gate commands (``--diag-verify``, ELASTIC_DIAG_VERIFY: run
    with ``bash -c``) only where the gate never runs them: no restart (``--max-restarts 0``, or none given:
    torchrun's default). Any abbreviation argparse would take counts."""
    gate = settings.ENV_VERIFY in env_names or any(a.partition("=")[0].startswith("--diag-v") for a in args)
    if not gate:
        return None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if len(name) > 4 and any(full.startswith(name) for full in ("--max-restarts", "--max_restarts")):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value != "0":
                return "a restart-gate command (--diag-verify, ELASTIC_DIAG_VERIFY) and restarts: the gate would run it"
    return None


def _python_refusal(args: Sequence[str]) -> str | None:
    """``python -m LAUNCHER ...`` or ``python -c <one of elastic_diag's own checks> ARGS``."""
    if args[:1] == ["-m"] and len(args) > 1:
        if args[1] not in PYTHON_MODULES:
            return f"-m {args[1]} is not one of the launchers a relaunch uses ({', '.join(sorted(PYTHON_MODULES))})"
        return _elastic_diag(args[2:]) if args[1] in ("elastic_diag", "elastic_diag.cli") else _launcher(args[2:])
    if args[:1] == ["-c"] and len(args) > 1:
        if args[1] not in own_python_checks():
            return "-c runs code that is not one of elastic_diag's own checks"
        return None
    return "only `python -m <launcher>` or `python -c <an elastic_diag check>` (no script, no other option)"


@lru_cache(maxsize=1)
def own_python_checks() -> frozenset[str]:
    """The code of every ``python -c`` elastic_diag writes into a report: the taxonomy's verification
    templates. (The restart gate's controls, gate/controls.py, run in the gate and are never written as a
    command: a report holding one is not elastic_diag's.)"""
    from elastic_diag.core.taxonomy import load_taxonomy
    from elastic_diag.core.verification import PLACEHOLDER

    found: set[str] = set()
    for sig in load_taxonomy():
        words = [w for kind, w in _Lexer(PLACEHOLDER.sub("x", sig.verify)).run().tokens if kind == "word"]
        found.update(words[i + 1] for i, w in enumerate(words[:-1]) if w == "-c")
    return frozenset(found)
