"""The body of `freetoken-verify` and `freetoken_verify.run`: validate everything, run, report.

`build_plan` takes typed values (lists of names and ints) and raises `freetoken_verify.errors` on
bad input; the command line parses its strings into those values first (`freetoken_verify.cli`), and
the Python API (`freetoken_verify.api`) passes them through."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import click

from freetoken.distributed import PlacementError, choose_placement
from freetoken.models.registry import canonical_chunks, check_tp
from freetoken_verify.cases.catalogue import CASES, CaseError, resolve_case
from freetoken_verify.checks.base import CHECK_NAMES, VerifyOptions, available_checks
from freetoken_verify.errors import InputError, UsageError
from freetoken_verify.faults import FAULTS
from freetoken_verify.reference.sources import reference_source
from freetoken_verify.reference.twin import TwinError, check_twin_space, is_quantized
from freetoken_verify.report.formats import count_line, render_table
from freetoken_verify.report.run_info import describe_run
from freetoken_verify.report.writer import ReportPaths, ReportWriter
from freetoken_verify.running.inputs import (
    check_case_files,
    check_reference_options,
    check_report_paths,
    save_references,
)
from freetoken_verify.running.options import (
    DEFAULT_TIMEOUT,
    DEFAULT_TP,
    DEVICES,
    DTYPES,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    MAX_SEED,
    REFERENCES,
    check_choice,
    check_count,
    check_names,
    check_seconds,
)
from freetoken_verify.running.progress import Progress
from freetoken_verify.running.runner import Plan, run_plan


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


def _options(device, dtype, reference, num_layers, oversubscribe, timeout, prompts_file=None,
             seed=None, max_new_tokens=None, save_reference=None, download=False
             ) -> VerifyOptions:
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)
                             or not 0 <= seed < MAX_SEED):
        raise UsageError(f"seed: {seed!r} is not an integer in [0, 2**63 - 4096)")
    return VerifyOptions(
        device=check_choice("device", device, DEVICES),
        dtype=check_choice("dtype", dtype, DTYPES),
        reference=_reference(reference),
        num_layers=None if num_layers is None else check_count("num_layers", num_layers),
        oversubscribe=bool(oversubscribe),
        timeout=check_seconds("timeout", timeout),
        prompts_file=None if prompts_file is None else str(prompts_file),
        seed=seed,
        max_new_tokens=None if max_new_tokens is None else check_count("max_new_tokens",
                                                                        max_new_tokens),
        save_reference=None if save_reference is None else str(save_reference),
        download=bool(download))


def _cases(models: Sequence[str], download: bool = False) -> list:
    names = [models] if isinstance(models, str) else list(models)
    if any(not isinstance(m, str) or not m.strip() for m in names):
        raise UsageError(f"models: empty or non-string entry in {names!r}")
    try:
        return [resolve_case(m, download) for m in names or sorted(CASES)]
    except CaseError as e:
        raise InputError(str(e)) from None


def build_plan(models: Sequence[str] = (), tp: Sequence[int] | int = DEFAULT_TP,
               checks: Sequence[str] = (), device: str = "auto", oversubscribe: bool = False,
               dtype: str = "auto", reference: str = "auto", num_layers: int | None = None,
               timeout: float = DEFAULT_TIMEOUT, faults: Sequence[str] = (),
               prompts_file: str | None = None, seed: int | None = None,
               max_new_tokens: int | None = None, save_reference: str | None = None,
               download: bool = False, bitwise: bool | None = None) -> Plan:
    """A validated plan: models (bundled case names, checkpoint folders or cached hub ids; all
    bundled cases when empty) x TP sizes x checks (all when empty), in run order. Raises
    `UsageError` for a malformed or unknown value and `InputError` for a model that cannot be
    verified as asked, before any rank starts. `reference` may also be a folder written by
    `save_reference`; `prompts_file`, `seed` and `max_new_tokens` choose the reference prompts
    and continuation (see `freetoken-verify --help`). `bitwise`: golden runs the engine's
    tp_invariant mode and requires TP=N to equal TP=1 bit for bit; None (default) turns it on
    where that mode runs (CPU ranks, TP sizes dividing each model's canonical chunk count)."""

    sizes = [tp] if isinstance(tp, int) else list(tp)
    if not sizes:
        raise UsageError("tp: no TP sizes given")
    tp_sizes = sorted({check_count("tp", size) for size in sizes})
    options = _options(device, dtype, reference, num_layers, oversubscribe, timeout,
                       prompts_file, seed, max_new_tokens, save_reference, download)
    wanted = check_names("checks", "check", checks, CHECK_NAMES)
    selected = {n: f for n, f in available_checks().items() if not wanted or n in wanted}
    fault_names = tuple(check_names("faults", "fault", faults, tuple(FAULTS), False))
    cases = _cases(models, options.download)
    _validate(cases, tp_sizes, options, selected)
    options = replace(options, bitwise=resolve_bitwise(bitwise, cases, tp_sizes, options))
    return Plan(cases, tp_sizes, selected, options, fault_names)


def resolve_bitwise(asked: bool | None, cases, tp_sizes: list[int],
                    options: VerifyOptions) -> bool:
    """Whether golden runs bitwise: as asked, else wherever the tp_invariant mode can run.
    UsageError when asked for where it cannot, naming why."""
    if asked is not None and not isinstance(asked, bool):
        raise UsageError(f"bitwise: {asked!r} is not True, False or None")
    if asked is False:
        return False
    device = choose_placement(options.device, max(tp_sizes), options.oversubscribe).device_for(0)
    why = None
    if not str(device).startswith("cpu"):
        why = f"the engine's tp_invariant mode runs on CPU ranks only (this run: {device})"
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
            allow_skips: bool = False) -> int:
    """The command line's run: check the report paths, build the plan from `plan_args`
    (`build_plan`'s keywords), run it with progress on stderr, writing the reports as rows
    finish (`freetoken_verify.report.writer`), print the table and the count line. Returns the
    exit status (`exit_status`)."""
    check_report_paths(report_json, junit_xml, summary_md)
    plan = build_plan(**plan_args)
    save_references(plan.cases, plan.tp_sizes, plan.options)
    if plan.faults:
        click.echo(f"injected faults: {', '.join(plan.faults)}", err=True)
    reports = ReportWriter(describe_run(plan),
                           ReportPaths(report_json, junit_xml, summary_md)).start()
    results = run_plan(plan, Progress(), on_result=reports.add)
    reports.finish()
    click.echo(render_table(results))
    if verbose:
        for r in results:
            if r.detail:
                click.echo(f"\n=== {r.model} {r.check} tp={r.tp} ===\n{r.detail}")
    for line in reports.errors:
        click.echo(f"error: {line}", err=True)
    code = exit_status(results, allow_skips)
    if code == EXIT_FAILED and not any(r.status in ("fail", "error") for r in results):
        click.echo("error: nothing was verified: every row was skipped (pass --allow-skips "
                   "when that is expected)", err=True)
    click.echo(count_line(results))
    return EXIT_USAGE if reports.errors else code


def exit_status(results: list, allow_skips: bool = False) -> int:
    """1 when a row failed or errored, and when no row ran at all (every row skipped, or none)
    unless `allow_skips`: a run that verified nothing is not a green one. Else 0."""
    if any(r.status in ("fail", "error") for r in results):
        return EXIT_FAILED
    if not allow_skips and not any(r.status == "pass" for r in results):
        return EXIT_FAILED
    return EXIT_OK
