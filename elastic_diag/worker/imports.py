"""Run a function the moment a module has been executed: how the worker's hooks reach torch's functions
before the script first calls them, without importing torch themselves.

:func:`when_imported` calls ``callback(module)`` at once when the module is already loaded, else right after
its body has run (a ``sys.meta_path`` finder that finds nothing itself: it asks the finders after it and
wraps the loader's ``exec_module``). A callback that raises never breaks the import. Standard library only.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_pending: dict[str, list[Callable[[Any], None]]] = {}


def _run(callback: Callable[[Any], None], module: Any) -> None:
    with contextlib.suppress(Exception):  # the import itself must never fail for a hook
        callback(module)


class _AfterImport:
    """The finder: for a module with callbacks pending, the spec the other finders give, its loader's
    ``exec_module`` followed by the callbacks."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _pending:
            return None
        import importlib.machinery

        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                loader = spec.loader

                def exec_module(module: Any, run: Any = loader.exec_module) -> None:
                    run(module)
                    with _lock:
                        callbacks = _pending.pop(name, [])
                        if not _pending:
                            _remove_finder()
                    for callback in callbacks:
                        _run(callback, module)

                loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec if isinstance(spec, importlib.machinery.ModuleSpec) else None
        return None


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]


def when_imported(name: str, callback: Callable[[Any], None]) -> None:
    """``callback(module)`` now if ``name`` is loaded, else as soon as it has been."""
    module = sys.modules.get(name)
    if module is not None:
        _run(callback, module)
        return
    with _lock:
        _pending.setdefault(name, []).append(callback)
        if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
