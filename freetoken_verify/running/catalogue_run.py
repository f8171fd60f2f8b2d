"""Run the bug catalogue (`freetoken_verify.faults.catalogue.CATALOGUE`): each entry's fault
injected into its bundled case, its checks at TP=1 and the TP sizes where it bites. `python -m
freetoken_verify.running.catalogue_run [FAULT ...]` prints one line per entry (caught and named,
or not) and the count line; exit 0 when every entry was caught and named, 1 when one was not,
2 for an unknown fault name (nothing runs)."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace

import click

from freetoken_verify.cases.catalogue import resolve_case
from freetoken_verify.checks import VerifyOptions, available_checks
from freetoken_verify.faults.catalogue import CATALOGUE, Entry
from freetoken_verify.report.formats import CheckResult
from freetoken_verify.running.plan import resolve_bitwise
from freetoken_verify.running.runner import Plan, run_plan


@dataclass
class Verdict:
    """What an entry's run showed: `problems` is empty when it was caught and named where it
    bites and green at TP=1 where it must be."""

    entry: Entry
    results: list[CheckResult]
    problems: list[str]


def run_entry(entry: Entry, timeout: float = 300.0, bitwise: bool | None = None) -> Verdict:
    """Inject `entry.fault` and run its checks in `entry.dtype`; judge the rows. `bitwise`
    as `--bitwise` / `--no-bitwise` take it (None: wherever the tp_invariant mode runs, as
    the command line does)."""
    results = run_rows(entry, timeout, bitwise)
    return Verdict(entry, results, judge(entry, results))


def run_rows(entry: Entry, timeout: float = 300.0, bitwise: bool | None = None
             ) -> list[CheckResult]:
    """The rows of `entry`'s run: its fault injected, its checks at TP=1 (where it must stay
    green) and the TP sizes where it bites."""
    sizes = sorted(set(entry.tp) | ({1} if entry.tp1_green else set()))
    checks = {n: f for n, f in available_checks().items() if n in entry.checks}
    cases = [resolve_case(entry.model)]
    options = VerifyOptions(device=entry.device, timeout=timeout, dtype=entry.dtype)
    options = replace(options, bitwise=resolve_bitwise(bitwise, cases, sizes, options))
    plan = Plan(cases, sizes, checks, options, (entry.fault,))
    return run_plan(plan, progress=lambda line: None)


def judge(entry: Entry, results: list[CheckResult]) -> list[str]:
    problems = []
    for tp in entry.tp:
        rows = [r for r in results if r.tp == tp and r.status in ("fail", "error")]
        if not rows:
            problems.append(f"tp={tp}: not caught (every row passed)")
        elif not any(re.search(entry.words, r.message) for r in rows):
            problems.append(f"tp={tp}: caught but not named ({entry.words!r} not in "
                            f"{rows[0].message!r})")
    if entry.tp1_green and 1 not in entry.tp:
        bad = [r for r in results if r.tp == 1 and r.status != "pass" and r.status != "skip"]
        problems += [f"tp=1 must pass (TP-only bug), got {r.status}: {r.message}" for r in bad]
    return problems


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("faults", nargs=-1, metavar="[FAULT]...")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0,
              show_default=True, help="seconds a rank group may take for one call")
def catalogue(faults: tuple[str, ...], timeout: float) -> int:
    """Inject each catalogued TP bug (all, or the FAULTs named) into its bundled case and say
    whether the checks caught and named it where it bites (and stayed green at TP=1 where the
    bug is TP-only). Names: `freetoken-verify --list`."""
    known = [e.fault for e in CATALOGUE]
    unknown = [f for f in faults if f not in known]
    if unknown:
        raise click.UsageError(f"unknown fault {', '.join(map(repr, unknown))}; catalogued "
                               f"faults are listed by `freetoken-verify --list`")
    entries = [e for e in CATALOGUE if not faults or e.fault in faults]
    failed = 0
    for entry in entries:
        verdict = run_entry(entry, timeout)
        failed += bool(verdict.problems)
        status = "MISSED" if verdict.problems else "caught"
        click.echo(f"{status:6s} {entry.fault}: "
                   f"{'; '.join(verdict.problems) or _named(verdict)}")
    click.echo(f"{len(entries) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """The catalogue run's exit status: 0 all caught and named, 1 one missed, 2 bad usage."""
    try:
        return catalogue.main(args=argv, prog_name="catalogue_run", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.UsageError as e:
        click.echo(f"error: {e.format_message()}", err=True)
        return 2


def _named(verdict: Verdict) -> str:
    row = next(r for r in verdict.results if r.status in ("fail", "error"))
    return f"tp={row.tp} {row.check}: {row.message}"


if __name__ == "__main__":
    sys.exit(main())
