"""The one exception tree of elastic_diag, and the launcher's exit codes.

::

    ElasticDiagError                 base of everything elastic_diag raises on purpose
    ├── UsageError                   bad flags, missing script, unwritable diag dir (exit 2)
    ├── TaxonomyError                a signature data file is malformed
    ├── EvidenceError                evidence on disk could not be read or parsed
    └── CommandRefused               `elastic-diag verify` will not run a report's command (exit 5)

Messages name the bad value and what to do about it.
"""

from __future__ import annotations

# Exit codes of torchrun-diag / elastic-diag run (stable, documented in docs/cli.md).
EXIT_OK = 0
EXIT_FAILED = 1  # the job failed, as plain torchrun exits
EXIT_USAGE = 2  # a usage error caught before any worker started (argparse uses 2 as well)
EXIT_RESTART_REFUSED = 3  # the job failed and the restart gate refused a restart
EXIT_VERIFY_FAILED = 4  # the job failed and a verification control failed, so no restart
EXIT_SIGNALLED = 128  # + the signal's number: the launcher was stopped from outside (143 SIGTERM, 130 SIGINT)

# Exit code of `elastic-diag verify` (0 the failure is gone, 1 still there, 2 usage): the report's command
# was not run (off the allow-list, no terminal to ask and no --yes, or the answer was not yes).
EXIT_NOT_RUN = 5


class ElasticDiagError(Exception):
    """Base class of every error elastic_diag raises on purpose."""


class UsageError(ElasticDiagError):
    """The command line or settings cannot work; raised before any worker starts."""


class TaxonomyError(ElasticDiagError):
    """A signature data file is malformed (names the file and the entry)."""


class EvidenceError(ElasticDiagError):
    """Evidence on disk could not be read or parsed."""


class CommandRefused(ElasticDiagError):
    """A report's verification command that ``elastic-diag verify`` will not run (says why and what to do)."""
