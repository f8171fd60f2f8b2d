"""The harness as a Python API: `freetoken_verify.run(...)` builds the same validated plan as
`freetoken-verify`, runs it and returns a `Report` instead of printing a table.

    import freetoken_verify

    report = freetoken_verify.run(models=["tiny-llama"], tp=[1, 2], checks=["golden", "shards"])
    report.assert_ok()

Bad input raises `freetoken_verify.errors.UsageError` or `InputError` (both `ValueError`s) before
any rank starts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from freetoken_verify.report.result import CheckResult, summarize
from freetoken_verify.running.options import DEFAULT_TP

Result = CheckResult
"""One check on one model at one TP size: the report's row itself (`status` pass, fail, skip
or error; `detail` the failing rank's traceback of an errored row; read-only, plain JSON)."""


@dataclass(frozen=True)
class Report:
    """Every result of a run, in run order."""

    results: tuple[Result, ...]

    def __post_init__(self):
        object.__setattr__(self, "results", tuple(self.results))

    @property
    def details(self) -> dict[tuple[str, str, int], str]:
        """The rank tracebacks of errored rows, keyed by (model, check, tp)."""
        return {(r.model, r.check, r.tp): r.detail for r in self.results if r.detail}

    @property
    def ok(self) -> bool:
        """No result failed or errored."""
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> tuple[Result, ...]:
        """The failed and errored results."""
        return tuple(r for r in self.results if not r.ok)

    @property
    def summary(self) -> dict[str, int]:
        """Counts by status, with the keys of the JSON report's `summary`."""
        return summarize(self.results)

    def assert_ok(self) -> None:
        """Raise AssertionError listing every failed or errored row (one per line, with its
        message) unless the run is ok."""
        if not self.ok:
            rows = "\n".join(r.describe() for r in self.failures)
            raise AssertionError(f"{len(self.failures)} of {len(self.results)} verification "
                                 f"rows failed:\n{rows}")


def run(models: Sequence[str] = (), tp: Sequence[int] | int = DEFAULT_TP,
        checks: Sequence[str] = (), *, faults: Sequence[str] = (),
        progress: bool | Callable[[str], None] = False, **options) -> Report:
    """Verify `models` (bundled case names, checkpoint folders or cached hub ids; every
    bundled case when empty) at each TP size in `tp` with `checks` (all when empty), as
    `freetoken-verify` would with the same options. `faults` injects known TP bugs by name
    (see `freetoken-verify --list`). `progress`: True prints the command line's progress on
    stderr, a callable receives its lines, False (default) is silent. `options` are the
    command line's options (`dtype="bfloat16"`, `num_layers=1`, `bitwise=False`, ...), named
    as the fields of `freetoken_verify.checks.VerifyOptions` and checked as the command
    line's are (`freetoken_verify.running.plan.checked_options`); `reference` may be a folder
    written by `save_reference`.

    Raises `freetoken_verify.errors.UsageError` / `InputError` for bad input before any rank
    starts."""
    # `import freetoken_verify` stays free of torch: the pytest plugin loads it in every session.
    from freetoken_verify.running.inputs import save_references
    from freetoken_verify.running.plan import build_plan
    from freetoken_verify.running.progress import Progress, quiet
    from freetoken_verify.running.runner import run_plan

    plan = build_plan(models, tp, checks, faults, **options)
    save_references(plan.cases, plan.tp_sizes, plan.options)
    reporter = Progress() if progress is True else quiet() if progress is False else \
        Progress(progress)
    rows = run_plan(plan, reporter)
    return Report(tuple(rows))
