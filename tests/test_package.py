"""The package's shape: the layers import only downwards, everything outside the worker, the agent, the
launch and the gate's controls imports without torch, and every entry point and import path users may
have written still resolves.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import elastic_diag

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "elastic_diag"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(_module_name(p) for p in PACKAGE.rglob("*.py") if "_boot" not in p.parts and p.name != "__main__.py")
# the modules that import torch when they are imported: they are built on torch's elastic agent, LogsSpecs,
# launcher and rendezvous classes. Everything else imports without torch (the promise covers the core, the
# offline analyzer and the reports; the rest of the agent, the worker and the gate import torch lazily).
NEEDS_TORCH = {"elastic_diag.agent.agent", "elastic_diag.agent.capture", "elastic_diag.agent.logs_specs",
               "elastic_diag.capture", "elastic_diag.launch.launcher", "elastic_diag.launch.rendezvous",
               "elastic_diag.launch.setup", "elastic_diag.rendezvous"}  # fmt: skip
TORCH_FREE = [m for m in MODULES if m not in NEEDS_TORCH]

# what each layer may import (by the first two parts of the module name); see docs/design.md
LAYER_OF = {
    "elastic_diag.errors": "base", "elastic_diag.config": "base", "elastic_diag._compat": "base",
    "elastic_diag.layout": "layout", "elastic_diag.redaction": "layout",
    "elastic_diag.core": "core", "elastic_diag.report": "report", "elastic_diag.offline": "offline",
    "elastic_diag.gate": "gate", "elastic_diag.worker": "worker", "elastic_diag.agent": "agent",
    "elastic_diag.ledger": "ledger",
    "elastic_diag.launch": "launch", "elastic_diag.cli": "front", "elastic_diag.run": "front",
    "elastic_diag.rendezvous": "front", "elastic_diag.capture": "front", "elastic_diag": "front",
    "elastic_diag.__main__": "front",
}  # fmt: skip
MAY_IMPORT = {
    "base": {"base"},
    "layout": {"base", "core", "layout"},  # the readers build the core's records; writes go through the redactor
    "core": {"base", "core"},  # pure: the evidence model and the rules; no file name, no reader
    "report": {"base", "layout", "core", "report"},
    "offline": {"base", "layout", "core", "report", "offline"},
    "gate": {"base", "layout", "core", "report", "gate"},  # the verification's judgement is the core's
    "worker": {"base", "layout", "worker"},
    "ledger": {"base", "layout", "core", "ledger"},  # the verdicts kept and told: no report, no torch
    "agent": {"base", "layout", "core", "report", "gate", "worker", "ledger", "agent"},
    "launch": {"base", "layout", "core", "report", "gate", "worker", "ledger", "agent", "launch"},
    "front": set(LAYER_OF.values()),
}  # fmt: skip


def _layer(module: str) -> str:
    for prefix in sorted(LAYER_OF, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYER_OF[prefix]
    raise AssertionError(f"{module} belongs to no layer: add it to LAYER_OF (and to docs/design.md)")


def _imports(path: Path) -> set[str]:
    """Every elastic_diag module the file imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("elastic_diag"):
            found.add(node.module)
            if node.module == "elastic_diag":  # `from elastic_diag import layout`: a module, or a name of the root
                found.update(f"elastic_diag.{a.name}" for a in node.names if f"elastic_diag.{a.name}" in MODULES)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("elastic_diag"))
    return found


def test_every_layer_imports_only_the_layers_below_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        mine = _layer(module)
        for imported in _imports(path):
            if imported != "elastic_diag" and _layer(imported) not in MAY_IMPORT[mine]:
                wrong.append(f"{module} ({mine}) imports {imported} ({_layer(imported)})")
    assert not wrong, "\n".join(wrong)


_NO_TORCH = """
import importlib, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is not installed here ({name})")
sys.meta_path.insert(0, NoTorch())
for name in sys.argv[1:]:
    importlib.import_module(name)
from elastic_diag.cli import main
assert main(["signatures"]) == 0
print("ok", len(sys.argv) - 1, sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""


def test_the_core_the_analyzer_and_the_reports_import_without_torch():
    promised = ("elastic_diag.core", "elastic_diag.offline", "elastic_diag.report", "elastic_diag.layout")
    assert {m for m in MODULES if m.startswith(promised)} <= set(TORCH_FREE)
    p = subprocess.run([sys.executable, "-c", _NO_TORCH, *TORCH_FREE], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == f"ok {len(TORCH_FREE)} []", p.stdout


@pytest.mark.parametrize("module", sorted(NEEDS_TORCH))
def test_the_modules_said_to_need_torch_do(module):
    """The list above is no way around the check: each module in it really imports torch, so torch-free
    code moved into one of them would be seen here."""
    p = subprocess.run([sys.executable, "-c", _NO_TORCH.split("from elastic_diag.cli")[0], module],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode != 0 and "torch is not installed here" in p.stderr


def test_public_surface_is_pinned():
    assert sorted(elastic_diag.__all__) == ["__version__", "elastic_launch", "heartbeat", "watch"]
    assert elastic_diag.__version__ == importlib.metadata.version("elastic-diag")


ENTRY_POINTS = {
    ("console_scripts", "torchrun-diag"): "elastic_diag.launch.run:_entry",
    ("console_scripts", "elastic-diag"): "elastic_diag.cli:_entry",
    ("torchrun.handlers", "diag+c10d"): "elastic_diag.launch.rendezvous:handler_factory",
    ("torchrun.logs_specs", "diag"): "elastic_diag.agent.logs_specs:DiagLogsSpecs",
}
# the paths earlier versions published (entry points, docs): each still names the same object
OLD_PATHS = {
    "elastic_diag.run:_entry": "elastic_diag.launch.run:_entry",
    "elastic_diag.run:main": "elastic_diag.launch.run:main",
    "elastic_diag.rendezvous:handler_factory": "elastic_diag.launch.rendezvous:handler_factory",
    "elastic_diag.capture:DiagLogsSpecs": "elastic_diag.agent.logs_specs:DiagLogsSpecs",
    "elastic_diag.agent:DiagAgent": "elastic_diag.agent.agent:DiagAgent",
    "elastic_diag.gate:RestartPolicy": "elastic_diag.gate.policy:RestartPolicy",
    "elastic_diag.gate:Decision": "elastic_diag.gate.policy:Decision",
    "elastic_diag.gate:AttemptOutcome": "elastic_diag.gate.policy:AttemptOutcome",
}


def _resolve(spec: str) -> object:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_entry_points_are_pinned_in_pyproject_and_installed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {("console_scripts", k): v for k, v in project["scripts"].items()}
    for group, entries in project["entry-points"].items():
        declared.update({(group, k): v for k, v in entries.items()})
    assert declared == ENTRY_POINTS
    installed = {(ep.group, ep.name): ep.value for ep in importlib.metadata.distribution("elastic-diag").entry_points}
    for key, value in ENTRY_POINTS.items():
        assert installed.get(key) == value, f"{key}: reinstall (pip install -e .) to refresh the entry points"
        assert callable(_resolve(value))


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_import_paths_still_resolve(old):
    assert _resolve(old) is _resolve(OLD_PATHS[old])


@pytest.mark.parametrize("argv", [["-m", "elastic_diag", "--version"], ["-m", "elastic_diag.run", "--version"],
                                  ["-m", "elastic_diag.cli", "--version"]])  # fmt: skip
def test_both_commands_print_the_version(argv):
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [p.stdout.split()[0], elastic_diag.__version__]
    assert p.stdout.split()[0] in ("elastic-diag", "torchrun-diag")


def test_python_dash_m_elastic_diag_is_elastic_diag():
    p = subprocess.run([sys.executable, "-m", "elastic_diag", "explain", "gloo-timeout"], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0 and p.stdout.startswith("gloo-timeout:"), p.stderr
