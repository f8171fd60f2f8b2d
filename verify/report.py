"""Check results and the three ways they leave the harness: a table, JSON and JUnit XML.

The JSON layout is the versioned report contract: change its keys only with a version bump.
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from tabulate import tabulate

STATUSES = ("pass", "fail", "skip", "error")
REPORT_VERSION = 1

# The table shows at most this many metrics, the ones a reader scans first.
_MAX_TABLE_METRICS = 5
_PREFERRED_METRICS = ("max_abs", "rel_l2", "top1_agree", "kl_max", "greedy_match", "mismatched",
                      "peak_bytes")
_SHORT_NAMES = {"top1_agree": "top1", "kl_max": "kl", "greedy_match": "greedy"}
_MESSAGE_WIDTH = 160
# XML 1.0 forbids most control characters; a traceback with terminal colours would otherwise
# produce a file CI cannot parse.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _plain(value, key: str):
    """Coerce torch/numpy scalars and containers of them to JSON-ready Python values."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, key) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"metric {key!r} has type {type(value).__name__}, not a JSON value")


def _json_safe(value):
    """Non-finite floats as strings: strict JSON readers (jq, browsers) reject Infinity/NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


@dataclass
class CheckResult:
    """The outcome of one check on one model at one TP size."""

    check: str
    model: str
    tp: int
    status: str
    seconds: float = 0.0
    placement: str = ""
    metrics: dict = field(default_factory=dict)
    message: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")
        self.tp = int(self.tp)
        self.seconds = float(self.seconds)
        self.metrics = {str(k): _plain(v, str(k)) for k, v in self.metrics.items()}

    def to_dict(self) -> dict:
        """The result as a strict-JSON-ready dict with exactly the contract's keys."""
        return _json_safe(asdict(self))


def summarize(results: Iterable[CheckResult]) -> dict:
    """Count results by status: passed, failed, skipped, errors."""
    counts = dict.fromkeys(STATUSES, 0)
    for result in results:
        counts[result.status] += 1
    return {"passed": counts["pass"], "failed": counts["fail"], "skipped": counts["skip"],
            "errors": counts["error"]}


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


def _short_message(result: CheckResult) -> str:
    if result.status == "pass":
        return ""
    text = " ".join(result.message.split())
    if len(text) <= _MESSAGE_WIDTH:
        return text
    return text[: _MESSAGE_WIDTH - 3] + "..."


def render_table(results: Iterable[CheckResult]) -> str:
    """One row per result; messages only where something needs attention."""
    headers = ["model", "check", "tp", "status", "placement", "metrics", "seconds", "message"]
    rows = [[r.model, r.check, r.tp, r.status.upper(), r.placement, _format_metrics(r.metrics),
             f"{r.seconds:.1f}", _short_message(r)] for r in results]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def environment(device: str, gpus: int) -> dict:
    """The versions and hardware a report was produced with.

    Versions come from package metadata rather than imports: importing triton on a machine
    without a GPU driver can fail or take seconds, and a report must still be written.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return {"torch": _package_version("torch"), "triton": _package_version("triton"),
            "transformers": _package_version("transformers"), "device": device,
            "gpus": int(gpus)}


def report_dict(results: Iterable[CheckResult], env: dict) -> dict:
    """The `--report-json` document, version 1 of the report contract."""
    results = list(results)
    return {"version": REPORT_VERSION, "env": env, "results": [r.to_dict() for r in results],
            "summary": summarize(results)}


def write_json(path, results: Iterable[CheckResult], env: dict) -> None:
    """Write the report contract as strict JSON to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report_dict(results, env), indent=2, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def _xml_text(text: str) -> str:
    return _XML_INVALID.sub("?", text)


def _testcase(suite: ET.Element, result: CheckResult) -> None:
    case = ET.SubElement(suite, "testcase", classname=f"{result.model}.tp{result.tp}",
                         name=result.check, time=f"{result.seconds:.3f}")
    message = _xml_text(result.message)
    metrics = json.dumps(_json_safe(result.metrics), indent=2, sort_keys=True)
    if result.status == "fail":
        ET.SubElement(case, "failure", message=message).text = _xml_text(metrics)
    elif result.status == "error":
        ET.SubElement(case, "error", message=message).text = _xml_text(metrics)
    elif result.status == "skip":
        ET.SubElement(case, "skipped", message=message)


def write_junit(path, results: Iterable[CheckResult]) -> None:
    """Write one JUnit <testsuite> with a <testcase> per result, for CI test reporters."""
    results = list(results)
    counts = summarize(results)
    suite = ET.Element("testsuite", name="freetoken-verify", tests=str(len(results)),
                       failures=str(counts["failed"]), errors=str(counts["errors"]),
                       skipped=str(counts["skipped"]),
                       time=f"{sum(r.seconds for r in results):.3f}")
    for result in results:
        _testcase(suite, result)
    tree = ET.ElementTree(suite)
    ET.indent(tree)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tree.write(path, encoding="utf-8", xml_declaration=True)
