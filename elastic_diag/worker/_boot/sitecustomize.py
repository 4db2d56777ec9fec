"""Loaded first by every worker Python that elastic_diag starts (its folder leads PYTHONPATH).

Installs the worker bootstrap, then imports the ``sitecustomize`` this interpreter would have
imported without us, so nothing of the environment's own start-up is lost.
"""

import time

_CPU_AT_START = time.process_time()

import importlib.util  # noqa: E402  (the clock first: the bootstrap's cost includes these imports)
import os  # noqa: E402
import sys  # noqa: E402


def _chain_to_original() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    mine = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    try:
        sys.path[:] = [p for p in saved if os.path.abspath(p or os.curdir) != here]
        if importlib.util.find_spec("sitecustomize") is not None:
            importlib.import_module("sitecustomize")
    except Exception as e:
        print(f"elastic_diag: the environment's own sitecustomize failed: {e!r}", file=sys.stderr)
    finally:
        sys.path[:] = [p for p in saved if os.path.abspath(p or os.curdir) != here]
        if "sitecustomize" not in sys.modules and mine is not None:
            sys.modules["sitecustomize"] = mine


try:
    from elastic_diag.worker.start import install_from_env
except Exception as e:  # the package is not importable from this interpreter: run without evidence
    print(f"elastic_diag: worker bootstrap unavailable: {e!r}", file=sys.stderr)
else:
    install_from_env(_CPU_AT_START)
_chain_to_original()
