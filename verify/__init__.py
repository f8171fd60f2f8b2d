"""`freetoken-verify`, the harness that proves the engine's TP path correct at every TP size.

The Python API: `verify.run(...) -> verify.Report` (see `verify.api`); bad input raises
`verify.UsageError` or `verify.InputError`."""

from verify.api import Report, Result, run
from verify.errors import InputError, UsageError, VerifyError

__all__ = ["InputError", "Report", "Result", "UsageError", "VerifyError", "run"]
