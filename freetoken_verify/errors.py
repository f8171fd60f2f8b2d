"""The errors `freetoken-verify`, `freetoken_verify.run` and the pytest fixture raise for bad input.

Both are `ValueError`s, so callers of the Python API can catch them without importing this
module; the command line turns either into its one `error: ...` line and exit status 2."""

from __future__ import annotations


class VerifyError(ValueError):
    """Base of the harness's input errors: the message is one line naming the culprit."""


class UsageError(VerifyError):
    """An argument is malformed or names something unknown (a TP size, a check, a fault)."""


class InputError(VerifyError):
    """An argument is well formed but what it names cannot be verified: a missing or damaged
    checkpoint, a TP size its config cannot split, an unwritable report path."""
