"""Runs the requested checks: one rank group per TP size, every model and check inside it."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from freetoken.distributed import MainModuleError, choose_placement
from freetoken_verify.cases.catalogue import Case
from freetoken_verify.checks.base import CHECK_NAMES, CheckContext, VerifyOptions, make_result
from freetoken_verify.checks.ranks import RankFailure, RankRunner
from freetoken_verify.checks.state import RunState
from freetoken_verify.faults import inject
from freetoken_verify.report.formats import CheckResult
from freetoken_verify.running.progress import Progress
from freetoken_verify.running.select import Selection


@dataclass
class Plan:
    """What to run: models x TP sizes x checks, validated before any rank starts."""

    cases: list[Case]
    tp_sizes: list[int]
    checks: dict[str, Callable[[CheckContext], CheckResult]]
    options: VerifyOptions
    faults: tuple[str, ...] = ()
    selection: Selection = field(default_factory=Selection)
    """Which model x check x TP rows run (`-k`, `--rerun-failed`); every row by default."""
    maxfail: int | None = None
    """Stop after this many failed or errored rows (`-x`: 1); None runs every row."""
    notes: tuple[str, ...] = ()
    """What the plan left out and why, said before the run starts."""

    def __post_init__(self):
        unknown = [name for name in self.checks if name not in CHECK_NAMES]
        if unknown:
            raise ValueError(f"plan names checks not in the table of checks: "
                             f"{', '.join(unknown)} (known: {', '.join(CHECK_NAMES)})")
        # The table's run order (each check after those it needs), whatever order was given.
        self.checks = {name: self.checks[name] for name in CHECK_NAMES if name in self.checks}

    def dtype_of(self, case: Case) -> str:
        """The dtype the engine runs `case` at (the checkpoint's for `auto`)."""
        return self.options.dtype if self.options.dtype != "auto" else case.model_config.dtype

    def rows(self) -> list[tuple[int, Case, str]]:
        """(tp, case, check name) of every row that runs, in run order."""
        return list(self.selection.rows(self))


def run_plan(plan: Plan, progress: Progress | Callable[[str], None] | None = None,
             on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Every selected row (`Plan.rows`: checks on models at TP sizes, TP outermost so each
    rank group starts once, and only for a TP size with rows), stopping after `plan.maxfail`
    failed or errored rows. `progress` gets a line per step (a callable: plain lines; None:
    stderr, updating in place on a terminal); `on_result` sees each result as it finishes.
    Every row's context carries the run's one RunState, where rows leave what later rows of
    the same run compare with."""
    progress = progress if isinstance(progress, Progress) else Progress(progress)
    say = progress.line
    results: list[CheckResult] = []
    state = RunState()
    rows = plan.rows()
    failed = 0
    for tp in sorted({tp for tp, _, _ in rows}):
        placement = choose_placement(plan.options.device, tp, plan.options.oversubscribe)
        setup = partial(inject, plan.faults) if plan.faults else None
        say(f"tp={tp}: starting {tp} rank(s), {placement.name}")
        with RankRunner(tp, placement, plan.options.timeout, setup=setup) as runner:
            for _, case, name in (row for row in rows if row[0] == tp):
                ctx = CheckContext(case, tp, runner, plan.options, state)
                with progress.step(f"[tp={tp}] {case.name} {name}"):
                    result = _run_one(name, plan.checks[name], ctx)
                results.append(result)
                if on_result is not None:
                    on_result(result)
                say(f"[{len(results)}/{len(rows)}] {case.name} {name} tp={tp}: "
                    f"{result.status.upper()} ({result.seconds:.1f}s)")
                failed += result.status in ("fail", "error")
                if plan.maxfail is not None and failed >= plan.maxfail:
                    say(f"stopping after {failed} failed row(s) (--maxfail {plan.maxfail}); "
                        f"{len(rows) - len(results)} row(s) not run")
                    return results
    return results


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
    return replace(make_result(name, ctx, start, "error", {}, message), detail=detail)
