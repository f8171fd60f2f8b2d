"""`freetoken-verify`, the harness that proves the engine's TP path correct at every TP size.

The Python API: `freetoken_verify.run(...) -> freetoken_verify.Report` (see
`freetoken_verify.api`); bad input raises `freetoken_verify.UsageError` or
`freetoken_verify.InputError`."""

from freetoken_verify.api import Report, Result, run
from freetoken_verify.errors import InputError, UsageError, VerifyError

__all__ = ["InputError", "Report", "Result", "UsageError", "VerifyError", "run"]
