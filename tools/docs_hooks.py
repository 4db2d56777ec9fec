"""MkDocs hooks: pages generated at build time from the code itself, so they cannot go stale.

* ``cli-reference.md``: every option of ``torchrun-diag`` (torch's own parser plus ours) and of each
  ``elastic-diag`` subcommand, read from the argparse parsers.
* ``examples.md``: every ``--inject`` of the two example scripts with the failure class it produces,
  read from ``examples/faults.py`` and the scripts' own tables.

(The signature pages are generated from the taxonomy by ``elastic-diag signatures --write-docs``
and committed; a test keeps them current.)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    for group in parser._action_groups:  # argparse keeps its groups private; the help output uses them too
        actions = [a for a in group._group_actions if not isinstance(a, argparse._SubParsersAction)]
        actions = [a for a in actions if a.help is not argparse.SUPPRESS and "-h" not in a.option_strings]
        if not actions:
            continue
        out += ["", f"**{group.title}**" + (f": {_cell(group.description)}" if group.description else ""), ""]
        out += ["| option | default | meaning |", "|---|---|---|"]
        for a in actions:
            if a.option_strings:
                metavar = "" if a.nargs == 0 else " " + (a.metavar or a.dest.upper())
                name = ", ".join(f"`{o}{metavar}`" for o in a.option_strings)
            else:
                name = f"`{a.metavar or a.dest}`" + (" ..." if a.nargs in ("+", "*", argparse.REMAINDER) else "")
            default = "" if a.default in (None, False, argparse.SUPPRESS) else f"`{a.default}`"
            out.append(f"| {name} | {default} | {_cell(a.help or '')} |")
    return out


def cli_reference() -> str:
    from elastic_diag.cli import get_parser as elastic_diag_parser
    from elastic_diag.launch.arguments import get_parser as torchrun_diag_parser

    lines = [
        "# CLI reference",
        "",
        "Generated from the argument parsers when these docs are built. For what the settings mean in",
        "practice, see [Command line](cli.md).",
        "",
        "## `torchrun-diag`",
        "",
        "Also `elastic-diag run` and `python -m elastic_diag.run`. Every option of torch's own `torchrun`",
        "parser, then elastic_diag's.",
    ]
    lines += _options_table(torchrun_diag_parser())
    top = elastic_diag_parser()
    lines += ["", "## `elastic-diag`", "", _cell(top.description or ""), ""]
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                lines += ["", f"### `elastic-diag {name}`", "", _cell(helps.get(name) or "")]
                if name == "run":
                    lines += ["", "The same command as `torchrun-diag`, above."]
                    continue
                lines += _options_table(sub)
    return "\n".join(lines) + "\n"


def _load(path: Path, name: str) -> Any:
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def examples_page() -> str:
    faults = _load(ROOT / "examples" / "faults.py", "faults")
    ddp = _load(ROOT / "examples" / "train_ddp.py", "train_ddp")
    fsdp2 = _load(ROOT / "examples" / "train_fsdp2.py", "train_fsdp2")
    lines = [
        "# Examples: every failure class, injected",
        "",
        "Two small CPU training scripts on gloo, `examples/train_ddp.py` (DistributedDataParallel) and",
        "`examples/train_fsdp2.py` (FSDP2, `fully_shard`), each with `--inject KIND`: the culprit rank",
        "(`--culprit-rank`, default 1) does it at `--at-step` (default 3) and the other ranks meet the",
        "consequences in their next collective, as in a real job. Every failure class elastic_diag knows",
        "has at least one injection. Every injection is run by a test, which checks the class and the rank",
        "named (`tests/test_examples.py` and the tests it lists; an FSDP2 injection that is the same",
        "`examples/faults.py` call as DDP's runs under DDP). Generated from `examples/faults.py` when these",
        "docs are built.",
        "",
        "```bash",
        "torchrun-diag --standalone --nproc-per-node 4 examples/train_fsdp2.py --inject nan --culprit-rank 2",
        "```",
        "",
        "Silent failures (hangs, desyncs) wait for the process-group timeout (`--pg-timeout`, default 30 s)",
        "unless the health monitor calls them first: add `--diag-hang-timeout 5`.",
        "",
        "| `--inject` | class reported | DDP | FSDP2 | how |",
        "|---|---|---|---|---|",
    ]
    for kind, cls in ddp.INJECTIONS.items():
        how = "simulated: raises what torch raises on a GPU" if kind in faults.SIMULATED else "real"
        if kind in ("straggler", "slow-first-step", "none"):
            how = "the job succeeds" + (" with a warning" if kind == "straggler" else "")
        in_fsdp2 = "yes" if kind in fsdp2.INJECTIONS else ""
        lines.append(f"| `{kind}` | `{cls}` | yes | {in_fsdp2} | {how} |")
    lines += [
        "",
        "The simulated ones (`cuda-oom`, `cuda-error`, `network-error`) need a GPU or an InfiniBand",
        "fabric to happen for real; on the CPU the culprit raises the same exception type with the message",
        "torch and NCCL print, so the classification, the report and the restart gate see what they would",
        "see on a cluster.",
    ]
    return "\n".join(lines) + "\n"


GENERATED = {"cli-reference.md": cli_reference, "examples.md": examples_page}


def on_files(files: Files, config: Any) -> Files:
    for name, make in GENERATED.items():
        files.append(File.generated(config, name, content=make()))
    return files
