"""The ways check results (`freetoken_verify.report.result`) leave the harness: a table, the
JSON report, JUnit XML and a markdown summary (`freetoken_verify.report.writer` writes the
files as rows finish).

The JSON layout is the versioned report contract (docs/report.md,
`freetoken_verify/report/schema.json`): change its keys only with a version bump.
"""

from __future__ import annotations

import json
import math
import re
import socket
import xml.etree.ElementTree as ET
from collections.abc import Iterable

from tabulate import tabulate

from freetoken_verify.report.result import CheckResult, json_safe, summarize
from freetoken_verify.report.run_info import dtype_label

REPORT_VERSION = 2

# The table shows at most this many metrics, the ones a reader scans first.
_MAX_TABLE_METRICS = 5
_PREFERRED_METRICS = ("max_abs", "rel_l2", "top1_agree", "kl_max", "greedy_match", "mismatched",
                      "peak_bytes")
_SHORT_NAMES = {"top1_agree": "top1", "kl_max": "kl", "greedy_match": "greedy"}
_MESSAGE_WIDTH = 160
_MIN_CELL = 16
"""The narrowest a shortened message or metrics cell gets when the table is fitted."""
_JUNIT_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
# XML 1.0 forbids most control characters; a traceback with terminal colours would otherwise
# produce a file CI cannot parse.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


def count_line(results: Iterable[CheckResult]) -> str:
    """The harness's last output line; errors count as failed."""
    s = summarize(results)
    return f"{s['passed']} passed, {s['failed'] + s['errors']} failed, {s['skipped']} skipped"


def _fmt_value(value, key: str = "") -> str:
    if key.endswith("_bytes") and isinstance(value, int):
        return f"{value / (1 << 20):.1f}MiB"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if value == 0.0:
        return "0"
    if not math.isfinite(value) or abs(value) < 1e-2 or abs(value) >= 1e4:
        return f"{value:.1e}"
    return f"{value:.3f}"


def _format_metrics(metrics: dict) -> str:
    """The key metrics, compactly: `max_abs=2.1e-06 top1=1.000 greedy=16/16`."""
    hidden = {"greedy_total"}
    # Lists and dicts (per-rank detail) belong in the JSON report, not in a table cell.
    scalar = {k for k, v in metrics.items() if not isinstance(v, (list, dict))}
    keys = [k for k in _PREFERRED_METRICS if k in scalar]
    keys += [k for k in metrics if k not in keys and k not in hidden and k in scalar]
    parts = []
    for key in keys[:_MAX_TABLE_METRICS]:
        value = _fmt_value(metrics[key], key)
        if key == "greedy_match" and "greedy_total" in metrics:
            value = f"{metrics['greedy_match']}/{metrics['greedy_total']}"
        parts.append(f"{_SHORT_NAMES.get(key, key)}={value}")
    return " ".join(parts)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 3, 1)] + "..."


def row_message(result: CheckResult) -> str:
    """The message on one line, without the `model tp=N:` the row already says."""
    text = " ".join(result.message.split())
    prefix = f"{result.model} tp={result.tp}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def _short_message(result: CheckResult, width: int = _MESSAGE_WIDTH) -> str:
    return "" if result.status == "pass" else _shorten(row_message(result), width)


def render_table(results: Iterable[CheckResult], width: int | None = None) -> str:
    """One row per result; messages only where something needs attention. With `width` (a
    terminal's columns) the message and then the metrics cells are shortened so that no line
    is wider (never below a readable minimum): the full messages are in `render_failures`."""
    results = list(results)
    headers = ["model", "check", "tp", "status", "placement", "metrics", "seconds", "message"]
    rows = [[r.model, r.check, str(r.tp), r.status.upper(), r.placement,
             _format_metrics(r.metrics), f"{r.seconds:.1f}", _short_message(r)]
            for r in results]
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    if width is None or not rows:
        return table
    for column in (7, 5):  # the message, then the metrics
        over = max(len(line) for line in table.splitlines()) - width
        if over <= 0:
            break
        longest = max(len(row[column]) for row in rows)
        cell = max(longest - over, _MIN_CELL)
        for row in rows:
            row[column] = _shorten(row[column], cell)
        table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    return table


def render_failures(results: Iterable[CheckResult], verbose: bool = False) -> str:
    """The FAILURES section printed after the table, pytest style: each failed or errored
    row's full message, and with `verbose` its detail (the failing rank's traceback); empty
    when nothing failed."""
    failed = [r for r in results if r.status in ("fail", "error")]
    if not failed:
        return ""
    lines = ["", "=" * 30 + " FAILURES " + "=" * 30]
    for r in failed:
        lines += [f"--- {r.model} {r.check} tp={r.tp} {r.status.upper()} ({r.placement}) ---",
                  r.message.strip()]
        if verbose and r.detail:
            lines += ["", r.detail.rstrip()]
        elif r.detail:
            lines.append("(the failing rank's traceback: run with -v)")
    return "\n".join(lines)


def report_dict(results: Iterable[CheckResult], info,
                complete: bool = True) -> dict:
    """The `--report-json` document, version 2 of the report contract: `info` (a
    `freetoken_verify.report.run_info.RunInfo`) says which run; each row carries its
    the failing rank's traceback; `complete` is False while the run is still going (or was
    killed)."""
    results = list(results)
    return {"version": REPORT_VERSION, "complete": complete, "env": info.env, "run": info.run,
            "models": info.models,
            "results": [r.to_dict() for r in results],
            "summary": summarize(results)}


def _xml_text(text: str) -> str:
    return _XML_INVALID.sub("?", text)


def _model_facts(info) -> dict:
    return {m["name"]: m for m in info.models}


def _properties(parent: ET.Element, values: dict) -> None:
    props = ET.SubElement(parent, "properties")
    for name, value in values.items():
        ET.SubElement(props, "property", name=name, value=_xml_text(str(value)))


def _body(result: CheckResult) -> str:
    """What a CI reporter shows for a failure: the message, the failing rank's traceback,
    the metrics."""
    parts = [result.message]
    if result.detail:
        parts.append(result.detail)
    if result.metrics:
        parts.append("metrics: " + json.dumps(json_safe(result.metrics), indent=2,
                                              sort_keys=True))
    return _xml_text("\n\n".join(parts))


def junit_name(text: str) -> str:
    """`text` with every run of characters other than letters, digits, `_` and `-` (the
    dots and slashes CI viewers split class names on) replaced by one `_`."""
    return _JUNIT_UNSAFE.sub("_", str(text)).strip("_") or "_"


def junit_classname(result: CheckResult, dtype: str, gpus: int) -> str:
    """`model.dtype.tpN.placement-Ggpu`: each part sanitised (`junit_name`), so the dots are
    the tree CI viewers draw (model, dtype, TP size, placement), and jobs on different
    machines (placements, GPU counts) never share an id when their files are merged."""
    return ".".join(junit_name(p) for p in (result.model, dtype, f"tp{result.tp}",
                                            f"{result.placement or 'none'}-{gpus}gpu"))


def _testcase(suite: ET.Element, result: CheckResult, model: dict, faults: str,
              gpus: int) -> None:
    dtype = dtype_label(model.get("dtype", "auto"))
    case = ET.SubElement(suite, "testcase", classname=junit_classname(result, dtype, gpus),
                         name=result.check, time=f"{result.seconds:.3f}")
    _properties(case, {"model": result.model, "tp": result.tp, "placement": result.placement,
                       "gpus": gpus, "seconds": f"{result.seconds:.3f}",
                       "dtype": model.get("dtype", "auto"),
                       "reference": model.get("reference", ""), "faults": faults})
    message = _xml_text(result.message)
    if result.status in ("fail", "error"):
        tag = "failure" if result.status == "fail" else "error"
        ET.SubElement(case, tag, message=message).text = _body(result)
    elif result.status == "skip":
        ET.SubElement(case, "skipped", message=message)


def _suite_attributes(name: str, results: list[CheckResult]) -> dict:
    counts = summarize(results)
    return {"name": name, "tests": str(len(results)), "failures": str(counts["failed"]),
            "errors": str(counts["errors"]), "skipped": str(counts["skipped"]),
            "time": f"{sum(r.seconds for r in results):.3f}"}


def junit_tree(results: Iterable[CheckResult], info) -> ET.Element:
    """JUnit XML: one <testsuite> per reference (`freetoken-verify.golden`,
    `freetoken-verify.hf`) with the run's start `timestamp` and the `hostname`, a <testcase>
    per result with classname `junit_classname` (model, dtype, TP size, placement and GPU
    count; the real model name in a property) and the check as name, so runs at another
    dtype, reference or machine never share an id."""
    results, models = list(results), _model_facts(info)
    faults = ",".join(info.run.get("faults") or ()) or "none"
    gpus = int(info.env.get("gpus") or 0)
    stamp = {"timestamp": str(info.run.get("started") or "").removesuffix("Z"),
             "hostname": _xml_text(socket.gethostname())}
    root = ET.Element("testsuites", _suite_attributes("freetoken-verify", results))
    groups: dict[str, list[CheckResult]] = {}
    for result in results:
        groups.setdefault(models.get(result.model, {}).get("reference", "none"), []).append(result)
    for reference, members in groups.items():
        suite = ET.SubElement(root, "testsuite",
                              _suite_attributes(f"freetoken-verify.{reference}", members) | stamp)
        _properties(suite, {k: info.run.get(k) for k in ("version", "git_commit", "started",
                                                         "dtype")}
                    | {"device": info.env.get("device"), "reference": reference,
                       "faults": faults})
        for result in members:
            _testcase(suite, result, models.get(result.model, {}), faults, gpus)
    ET.indent(root)
    return root


def _md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def markdown_summary(results: Iterable[CheckResult], info, complete: bool = True) -> str:
    """A markdown summary for CI job summaries: a heading with the counts and what ran, the
    passing rows collapsed into counts per check, a table of the rows that need attention
    (failed, errored, skipped) and every failure's full message."""
    results, models, run = list(results), _model_facts(info), info.run
    tp = ",".join(map(str, run.get("arguments", {}).get("tp", [])))
    state = "" if complete else " (incomplete)"
    lines = [f"### freetoken-verify: {count_line(results)}{state}", "",
             f"dtype {run.get('dtype')} · reference {run.get('reference')} · TP {tp} · "
             f"device {info.env.get('device')} ({info.env.get('gpus')} GPUs) · faults "
             f"{', '.join(run.get('faults') or ()) or 'none'} · freetoken "
             f"{run.get('version')} · commit {(run.get('git_commit') or 'none')[:12]}", ""]
    passed: dict[str, list[CheckResult]] = {}
    for r in results:
        if r.status == "pass":
            passed.setdefault(r.check, []).append(r)
    if passed:
        lines += ["Passed: " + " · ".join(
            f"{check} {len(rows)} ({len({r.model for r in rows})} models, TP "
            f"{','.join(str(t) for t in sorted({r.tp for r in rows}))})"
            for check, rows in passed.items()), ""]
    attention = [r for r in results if r.status != "pass"]
    if attention:
        lines += ["| model | dtype | reference | tp | check | status | placement | metrics | s "
                  "| message |", "|" + "---|" * 10]
    for r in attention:
        model = models.get(r.model, {})
        status = r.status.upper()
        lines.append("| " + " | ".join(_md_cell(c) for c in (
            r.model, dtype_label(model.get("dtype", "")), model.get("reference", ""), r.tp,
            r.check, status if r.status == "skip" else f"**{status}**", r.placement,
            _format_metrics(r.metrics), f"{r.seconds:.1f}", _short_message(r))) + " |")
    failed = [r for r in attention if r.status in ("fail", "error")]
    if failed:
        lines += ["", "#### Failures", ""]
        for r in failed:
            body = r.message.strip().replace("`" * 3, "` ` `")
            lines += [f"**{_md_cell(r.model)} {r.check} tp={r.tp} {r.status.upper()}**", "",
                      "`" * 3, body, "`" * 3, ""]
    return "\n".join(lines).rstrip("\n") + "\n"
