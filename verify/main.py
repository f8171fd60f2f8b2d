"""The body of `freetoken-verify`: validate everything, run, report."""

from __future__ import annotations

import click

from freetoken.distributed import PlacementError, choose_placement
from verify.cases import CASES, CaseError, resolve_case
from verify.checks import ALL_CHECK_NAMES, VerifyOptions, available_checks
from verify.inputs import (
    check_case_files,
    check_reference_options,
    check_report_paths,
    save_references,
)
from verify.options import EXIT_FAILED, EXIT_OK, EXIT_USAGE, parse_tp, split_values
from verify.references import reference_source
from verify.report import count_line, environment, render_table, write_json, write_junit
from verify.runner import Plan, run_plan


def _fail_usage(message: str) -> None:
    raise click.UsageError(message)


def _checks(requested: list[str]) -> dict:
    available = available_checks()
    for name in requested:
        if name not in ALL_CHECK_NAMES:
            _fail_usage(f"unknown check {name!r}; available: {', '.join(available)}")
        if name not in available:
            _fail_usage(f"check {name!r} is not available in this build; available: "
                        f"{', '.join(available)}")
    return {n: f for n, f in available.items() if not requested or n in requested}


def _validate(cases, tp_sizes, options, selected: dict) -> None:
    from freetoken.models.registry import check_tp

    for case in cases:
        check_case_files(case)
        cfg = case.model_config
        try:
            if options.num_layers is not None:
                cfg = cfg.truncated(options.num_layers)
            for tp in tp_sizes:
                check_tp(cfg, tp)
        except ValueError as e:
            _fail_usage(f"{case.name}: {e}")
        source = reference_source(case, options)
        if source == "golden" and (not case.bundled or options.num_layers is not None):
            _fail_usage(f"{case.name}: --reference golden needs a bundled case at full depth")
        if source == "hf" and case.model_config.quantization is not None and \
                "golden" in selected:
            _fail_usage(f"{case.name}: HF transformers cannot run this quantized checkpoint as a "
                        "live reference; verify a bundled case against its stored golden, or "
                        "use --checks shards,memory,kernels")
    for tp in tp_sizes:
        try:
            choose_placement(options.device, tp, options.oversubscribe)
        except PlacementError as e:
            _fail_usage(str(e))
    check_reference_options(cases, options)


def build_plan(models, tp, checks, device, oversubscribe, dtype, reference, num_layers,
               timeout, faults, **reference_options) -> Plan:
    tp_sizes = parse_tp(tp)
    if not tp_sizes:
        _fail_usage("--tp: no TP sizes given")
    options = VerifyOptions(device, dtype, reference, num_layers, oversubscribe, timeout,
                            **reference_options)
    selected = _checks(split_values(checks, "--checks"))
    try:
        cases = [resolve_case(m, options.download)
                 for m in split_values(models, "--model") or sorted(CASES)]
    except CaseError as e:
        _fail_usage(str(e))
    _validate(cases, tp_sizes, options, selected)
    return Plan(cases, tp_sizes, selected, options, tuple(faults))


def execute(models, tp, checks, device, oversubscribe, dtype, reference, num_layers,
            report_json, junit_xml, timeout, faults, verbose, **reference_options) -> int:
    check_report_paths(report_json, junit_xml)
    plan = build_plan(models, tp, checks, device, oversubscribe, dtype, reference, num_layers,
                      timeout, faults, **reference_options)
    save_references(plan.cases, plan.tp_sizes, plan.options)
    if plan.faults:
        click.echo(f"injected faults: {', '.join(plan.faults)}", err=True)
    results = run_plan(plan)
    click.echo(render_table(results))
    if verbose:
        for (model, check, tp_size), detail in plan.details.items():
            click.echo(f"\n=== {model} {check} tp={tp_size} ===\n{detail}")
    resolved = "cuda" if any(r.placement.startswith("cuda") for r in results) else "cpu"
    env = environment(resolved, _gpu_count())
    written = [_write_report("--report-json", report_json, write_json, results, env),
               _write_report("--junit-xml", junit_xml, write_junit, results)]
    click.echo(count_line(results))
    bad = any(r.status in ("fail", "error") for r in results)
    if not all(written):
        return EXIT_USAGE
    return EXIT_FAILED if bad else EXIT_OK


def _write_report(option: str, path: str | None, writer, *args) -> bool:
    """Write one report; a path that became unwritable during the run (checked before it)
    is one error line, and the other report and the count line still come out."""
    if not path:
        return True
    try:
        writer(path, *args)
    except OSError as e:
        click.echo(f"error: {option}: could not write {path} ({e.strerror or e})", err=True)
        return False
    return True


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
