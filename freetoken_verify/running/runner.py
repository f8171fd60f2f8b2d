"""Runs the requested checks: one rank group per TP size, every model and check inside it."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from freetoken.distributed import MainModuleError, choose_placement
from freetoken_verify.cases.catalogue import CASES, Case
from freetoken_verify.checks.base import CheckContext, VerifyOptions, make_result
from freetoken_verify.checks.ranks import RankFailure, RankRunner
from freetoken_verify.faults import inject
from freetoken_verify.report.formats import CheckResult
from freetoken_verify.running.progress import Progress


@dataclass
class Plan:
    """What to run: models x TP sizes x checks, validated before any rank starts."""

    cases: list[Case]
    tp_sizes: list[int]
    checks: dict[str, Callable[[CheckContext], CheckResult]]
    options: VerifyOptions
    faults: tuple[str, ...] = ()


def run_plan(plan: Plan, progress: Progress | Callable[[str], None] | None = None,
             on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Every check on every model at every TP size, in that nesting (TP outermost so each
    rank group starts once). `progress` gets a line per step (a callable: plain lines; None:
    stderr, updating in place on a terminal); `on_result` sees each result as it finishes."""
    progress = progress if isinstance(progress, Progress) else Progress(progress)
    say = progress.line
    results: list[CheckResult] = []
    cache: dict = {}
    total = len(plan.cases) * len(plan.tp_sizes) * len(plan.checks)
    for tp in plan.tp_sizes:
        placement = choose_placement(plan.options.device, tp, plan.options.oversubscribe)
        setup = partial(inject, plan.faults) if plan.faults else None
        say(f"tp={tp}: starting {tp} rank(s), {placement.name}")
        with RankRunner(tp, placement, plan.options.timeout, setup=setup) as runner:
            for case in plan.cases:
                for name, check in plan.checks.items():
                    ctx = CheckContext(case, tp, runner, plan.options, cache)
                    with progress.step(f"[tp={tp}] {case.name} {name}"):
                        result = _run_one(name, check, ctx)
                    if not plan.faults:
                        result = known_gap(result, case)
                    results.append(result)
                    if on_result is not None:
                        on_result(result)
                    say(f"[{len(results)}/{total}] {case.name} {name} tp={tp}: "
                        f"{result.status.upper()} ({result.seconds:.1f}s)")
    return results


def known_gap(result: CheckResult, case: Case) -> CheckResult:
    """`result`, or, where it fails a check that a bundled case lists as waiting on harness
    support for its format (`CaseSpec.pending`), a skip that says what the check waits on
    and keeps the failure's message. A pass or an error stands: a pending check that passes
    is told apart by the test that holds every pending entry to a failure."""
    spec = CASES.get(case.name) if case.bundled else None
    waits = spec.pending.get(result.check) if spec is not None else None
    if waits is None or result.status != "fail":
        return result
    return replace(result, status="skip",
                   message=f"pending: {result.check} does not yet read {waits}; it fails: "
                           f"{result.message}")


def _run_one(name: str, check, ctx: CheckContext) -> CheckResult:
    """The check's row; an exception becomes an error row carrying the failing rank's (or the
    check's own) traceback as its detail."""
    start = time.monotonic()
    try:
        return check(ctx)
    except RankFailure as e:
        detail, message = e.detail(), f"{ctx.case.name} tp={ctx.tp}: {e}"
    except MainModuleError:
        raise  # no rank can start at all: the caller's script, not this row, is at fault
    except Exception as e:  # a check's own bug must not hide the other results
        detail = traceback.format_exc()
        message = f"{ctx.case.name} tp={ctx.tp}: {type(e).__name__}: {e}"
    result = make_result(name, ctx, start, "error", {}, message)
    result.detail = detail
    return result
