"""The checks `freetoken-verify` runs, each in its own module, all with one signature:
`run(ctx: CheckContext) -> CheckResult`. The table of checks and what they share live in
`freetoken_verify.checks.base`; this package re-exports them."""

from __future__ import annotations

from freetoken_verify.checks.base import (
    CHECK_NAMES,
    CHECKS,
    CheckContext,
    CheckSpec,
    VerifyOptions,
    available_checks,
    make_result,
)

__all__ = ["CHECKS", "CHECK_NAMES", "CheckContext", "CheckSpec", "VerifyOptions",
           "available_checks", "make_result"]
