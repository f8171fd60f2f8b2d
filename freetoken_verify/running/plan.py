"""The body of `freetoken-verify` and `freetoken_verify.run`: validate everything, run, report.

`build_plan` takes typed values (lists of names and ints) and raises `freetoken_verify.errors` on
bad input; the command line parses its strings into those values first (`freetoken_verify.cli`), and
the Python API (`freetoken_verify.api`) passes them through."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import click

from freetoken.distributed import PlacementError, choose_placement
from freetoken.models.registry import canonical_chunks, check_tp
from freetoken_verify.cases.catalogue import CASES, CaseError, resolve_case
from freetoken_verify.checks.base import CHECK_NAMES, VerifyOptions, available_checks
from freetoken_verify.errors import InputError, UsageError, VerifyError
from freetoken_verify.faults import FAULTS
from freetoken_verify.faults.catalogue import CATALOGUE
from freetoken_verify.reference.sources import reference_source
from freetoken_verify.reference.twin import TwinError, check_twin_space, is_quantized
from freetoken_verify.report.formats import (
    CheckResult,
    count_line,
    render_failures,
    render_table,
)
from freetoken_verify.report.run_info import describe_refused_run, describe_run
from freetoken_verify.report.writer import ReportPaths, ReportWriter
from freetoken_verify.running.inputs import (
    check_case_files,
    check_reference_options,
    check_report_paths,
    save_references,
)
from freetoken_verify.running.options import (
    DEFAULT_TP,
    DEVICES,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    MAX_SEED,
    REFERENCES,
    check_choice,
    check_count,
    check_dtype,
    check_names,
    check_seconds,
)
from freetoken_verify.running.progress import Progress
from freetoken_verify.running.runner import Plan, run_plan
from freetoken_verify.running.select import Selection


def _validate(cases, tp_sizes, options, selected: dict) -> None:
    for case in cases:
        check_case_files(case)
        cfg = case.model_config
        try:
            if options.num_layers is not None:
                cfg = cfg.truncated(options.num_layers)
            for tp in tp_sizes:
                check_tp(cfg, tp)
        except ValueError as e:
            raise InputError(f"{case.name}: {e}") from None
        source = reference_source(case, options)
        if source == "golden" and (not case.bundled or options.num_layers is not None):
            raise InputError(f"{case.name}: --reference golden needs a bundled case at full "
                             "depth")
        if is_quantized(case) and runs_hf(source, options, selected):
            try:
                check_twin_space(case, options.num_layers)
            except TwinError as e:
                raise InputError(str(e)) from None
    for tp in tp_sizes:
        try:
            choose_placement(options.device, tp, options.oversubscribe)
        except PlacementError as e:
            raise InputError(str(e)) from None
    check_reference_options(cases, options)


def runs_hf(source: str, options, selected: dict) -> bool:
    """Whether the run computes HF live (and so, for a quantized checkpoint, needs its
    dequantized twin): `--save-reference`, golden against live HF, bisect without a saved
    reference."""
    return bool(options.save_reference) or (source == "hf" and "golden" in selected) or \
        (source != "stored" and "bisect" in selected)


def _reference(reference) -> str:
    """One of REFERENCES, or a folder written by `--save-reference` (checked, with the
    checkpoint it must match, by `check_reference_options`)."""
    if isinstance(reference, str) and reference not in REFERENCES and reference.strip():
        if Path(reference).is_dir():
            return reference
        raise UsageError(f"reference: {reference!r} is neither {', '.join(REFERENCES[:-1])}, "
                         f"{REFERENCES[-1]} nor a folder written by --save-reference")
    return check_choice("reference", reference, REFERENCES)


def _seed(seed) -> int | None:
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)
                             or not 0 <= seed < MAX_SEED):
        raise UsageError(f"seed: {seed!r} is not an integer in [0, 2**63 - 4096)")
    return seed


def _optional(check):
    return lambda value: None if value is None else check(value)


_OPTION_CHECKS = {
    # seed first: where several values are bad, the error names the same one as always.
    "seed": _seed,
    "device": lambda value: check_choice("device", value, DEVICES),
    "dtype": lambda value: check_dtype("dtype", value),
    "reference": _reference,
    "num_layers": _optional(lambda value: check_count("num_layers", value)),
    "oversubscribe": bool,
    "timeout": lambda value: check_seconds("timeout", value),
    "prompts_file": _optional(str),
    "max_new_tokens": _optional(lambda value: check_count("max_new_tokens", value)),
    "save_reference": _optional(str),
    "download": bool,
    # Checked, and resolved where None, once the cases are known (`resolve_bitwise`).
    "bitwise": lambda value: value,
}
"""Each option a user gives (a `VerifyOptions` field, spelled as the command line's flag and
`freetoken_verify.run`'s keyword), and how its value is checked."""


def checked_options(values: dict) -> VerifyOptions:
    """The run's `VerifyOptions` from the option values the command line and
    `freetoken_verify.run` pass (`_OPTION_CHECKS`'s names; an absent one keeps its default),
    each checked: UsageError naming a malformed value, TypeError naming a name that is no
    option (as Python says of an unknown keyword)."""
    unknown = sorted(set(values) - set(_OPTION_CHECKS))
    if unknown:
        raise TypeError(f"unexpected option {unknown[0]!r}; the options are "
                        f"{', '.join(sorted(_OPTION_CHECKS))}")
    # Not given, bitwise is asked for nowhere: it then runs wherever it can.
    given = {"bitwise": None, **values}
    return VerifyOptions(**{name: check(given[name]) for name, check in _OPTION_CHECKS.items()
                            if name in given})


def _cases(models: Sequence[str], download: bool = False) -> list:
    names = [models] if isinstance(models, str) else list(models)
    if any(not isinstance(m, str) or not m.strip() for m in names):
        raise UsageError(f"models: empty or non-string entry in {names!r}")
    try:
        return [resolve_case(m, download) for m in names or sorted(CASES)]
    except CaseError as e:
        raise InputError(str(e)) from None


def build_plan(models: Sequence[str] = (), tp: Sequence[int] | int = DEFAULT_TP,
               checks: Sequence[str] = (), faults: Sequence[str] = (),
               keyword: str | None = None, only: frozenset | None = None,
               maxfail: int | None = None, **options) -> Plan:
    """A validated plan: models (bundled case names, checkpoint folders or cached hub ids; all
    bundled cases when empty) x TP sizes x checks (all when empty), in run order, under
    `options`: the option values, by their `VerifyOptions` names (`checked_options`). Raises
    `UsageError` for a malformed or unknown value and `InputError` for a model that cannot be
    verified as asked, before any rank starts. `reference` may also be a folder written by
    `save_reference`; `prompts_file`, `seed` and `max_new_tokens` choose the reference prompts
    and continuation (see `freetoken-verify --help`). `bitwise`: golden runs the engine's
    tp_invariant mode and requires TP=N to equal TP=1 bit for bit; None (default) turns it on
    where that mode runs (TP sizes dividing each model's canonical chunk count).
    `keyword` (`-k`) and `only` ((model, check, tp) rows, `--rerun-failed`) select rows;
    `maxfail` stops the run after that many failed rows.

    The kernels check runs in full when it is named, or when something its Triton matrices
    cover is in play: GPU ranks (the engine's Triton kernels) or an injected fault the
    catalogue says it catches. Otherwise (CPU ranks, which run the engine's torch path and no
    Triton kernel) a default run keeps only its quantized GEMMs (the engine's CPU path of a
    quantized model) or, without a quantized model, leaves it out, and says so in
    `Plan.notes`."""

    sizes = [tp] if isinstance(tp, int) else list(tp)
    if not sizes:
        raise UsageError("tp: no TP sizes given")
    tp_sizes = sorted({check_count("tp", size) for size in sizes})
    options = checked_options(options)
    wanted = check_names("checks", "check", checks, CHECK_NAMES)
    selected = {n: f for n, f in available_checks().items() if not wanted or n in wanted}
    fault_names = tuple(check_names("faults", "fault", faults, tuple(FAULTS), False))
    if maxfail is not None:
        maxfail = check_count("maxfail", maxfail)
    selection = Selection(None if keyword is None else str(keyword), only)
    notes = ()
    cases = _cases(models, options.download)
    if not wanted and "kernels" in selected and not _kernels_in_play(tp_sizes, options,
                                                                     fault_names):
        options = replace(options, kernel_matrices=False)
        if any(c.model_config.quantization is not None for c in cases):
            notes = ("kernels: the quantized GEMMs only (CPU ranks run no Triton kernel and no "
                     "injected fault touches one); --checks kernels runs the kernel matrices "
                     "too",)
        else:
            del selected["kernels"]
            notes = ("kernels: left out (CPU ranks run no Triton kernel, no model is quantized "
                     "and no injected fault touches one); --checks kernels runs it",)
    _validate(cases, tp_sizes, options, selected)
    options = replace(options, bitwise=resolve_bitwise(options.bitwise, cases, tp_sizes,
                                                       options))
    plan = Plan(cases, tp_sizes, selected, options, fault_names, selection, maxfail, notes)
    if not plan.rows():
        raise UsageError("no row is selected: "
                         f"{'-k ' + repr(keyword) if keyword else 'the selection'} matches none "
                         "of the planned model x check x TP rows (--dry-run lists them)")
    return plan


def _kernels_in_play(tp_sizes: list[int], options: VerifyOptions, faults: tuple[str, ...]
                     ) -> bool:
    """GPU ranks at some TP size, or a fault the kernels check is catalogued to catch."""
    if any(choose_placement(options.device, tp, options.oversubscribe).is_cuda
           for tp in tp_sizes):
        return True
    return any(e.fault in faults and "kernels" in e.checks for e in CATALOGUE)


def print_dry_run(plan: Plan, echo=click.echo) -> int:
    """`--dry-run`: the rows the plan would run, one per line, and their count; no rank
    starts."""
    for note in plan.notes:
        echo(f"note: {note}")
    rows = plan.rows()
    for tp, case, name in rows:
        placement = choose_placement(plan.options.device, tp, plan.options.oversubscribe)
        echo(f"{case.name} {name} tp={tp} {plan.dtype_of(case)} {placement.name}")
    echo(f"{len(rows)} row(s) planned")
    return EXIT_OK


def resolve_bitwise(asked: bool | None, cases, tp_sizes: list[int],
                    options: VerifyOptions) -> bool:
    """Whether golden runs bitwise: as asked, else wherever the tp_invariant mode can run.
    UsageError when asked for where it cannot, naming why."""
    if asked is not None and not isinstance(asked, bool):
        raise UsageError(f"bitwise: {asked!r} is not True, False or None")
    if asked is False:
        return False
    why = None
    for case in cases:
        cfg = case.model_config if options.num_layers is None else \
            case.model_config.truncated(options.num_layers)
        chunks = canonical_chunks(cfg)
        bad = [tp for tp in tp_sizes if chunks % tp]
        if why is None and bad:
            why = (f"{case.name}: tp={bad[0]} does not divide its canonical chunk count "
                   f"{chunks}")
    if why is not None and asked:
        raise UsageError(f"--bitwise: {why}; pass --no-bitwise")
    return why is None


def execute(plan_args: dict, report_json: str | None = None, junit_xml: str | None = None,
            verbose: bool = False, summary_md: str | None = None,
            allow_skips: bool = False, dry_run: bool = False) -> int:
    """The command line's run: check the report paths, build the plan from `plan_args`
    (`build_plan`'s keywords), run it with progress on stderr, writing the reports as rows
    finish (`freetoken_verify.report.writer`), print the table and the count line. Returns the
    exit status (`exit_status`)."""
    check_report_paths(report_json, junit_xml, summary_md)
    paths = ReportPaths(report_json, junit_xml, summary_md)
    try:
        plan = build_plan(**plan_args)
    except VerifyError as e:
        if not dry_run:
            write_refused(plan_args, e, paths)
        raise
    if dry_run:
        return print_dry_run(plan)
    for note in plan.notes:
        click.echo(f"note: {note}", err=True)
    save_references(plan.cases, plan.tp_sizes, plan.options)
    if plan.faults:
        click.echo(f"injected faults: {', '.join(plan.faults)}", err=True)
    reports = ReportWriter(describe_run(plan), paths).start()
    results = run_plan(plan, Progress(), on_result=reports.add)
    reports.finish()
    click.echo(render_table(results, width=console_width()))
    failures = render_failures(results, verbose)
    if failures:
        click.echo(failures)
    for line in reports.errors:
        click.echo(f"error: {line}", err=True)
    code = exit_status(results, allow_skips)
    if code == EXIT_FAILED and not any(r.status in ("fail", "error") for r in results):
        click.echo("error: nothing was verified: every row was skipped (pass --allow-skips "
                   "when that is expected)", err=True)
    click.echo(count_line(results))
    return EXIT_USAGE if reports.errors else code


def write_refused(plan_args: dict, error: Exception, paths: ReportPaths) -> None:
    """Reports for a run refused before any rank started: one `error` row (check `setup`,
    placement `none`) carrying the refusal, so a CI job that reads the reports shows a failure
    instead of a missing file. A report that cannot be written is left out silently: the
    refusal itself is what the user sees."""
    if not (paths.json or paths.junit or paths.summary_md):
        return
    models = plan_args.get("models") or ()
    model = ", ".join(models if not isinstance(models, str) else [models]) or "bundled cases"
    sizes = [t for t in (plan_args.get("tp") or ()) if isinstance(t, int) and t >= 1] \
        if not isinstance(plan_args.get("tp"), int) else [plan_args["tp"]]
    row = CheckResult("setup", model, min(sizes, default=1), "error", placement="none",
                      message=f"refused before any rank started: {error}")
    reports = ReportWriter(describe_refused_run(plan_args, error), paths).start()
    reports.add(row)
    reports.finish()


def console_width() -> int:
    """The terminal's columns (`COLUMNS` when set; 160 when stdout is not a terminal, so a CI
    log keeps a readable table while the FAILURES section carries the full messages)."""
    return shutil.get_terminal_size(fallback=(160, 24)).columns


def exit_status(results: list, allow_skips: bool = False) -> int:
    """1 when a row failed or errored, and when no row ran at all (every row skipped, or none)
    unless `allow_skips`: a run that verified nothing is not a green one. Else 0."""
    if any(r.status in ("fail", "error") for r in results):
        return EXIT_FAILED
    if not allow_skips and not any(r.status == "pass" for r in results):
        return EXIT_FAILED
    return EXIT_OK
