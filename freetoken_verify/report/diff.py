"""`freetoken-verify diff OLD.json NEW.json`: which rows of two reports (`--report-json`)
changed. Rows are matched by model, dtype, check and TP size; a row is listed when its status
changed, when it is only in one report, or when a numeric metric moved by more than
`METRIC_FACTOR` (or between zero and non-zero). Exit 1 when a row that passed in OLD fails or
errors in NEW (a regression), else 0; 2 when a file is not a report."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from freetoken_verify.errors import UsageError

METRIC_FACTOR = 10.0
"""A metric listed as changed moved by more than this factor either way."""
_BAD = ("fail", "error")


@dataclass(frozen=True)
class RowKey:
    """What matches a row of one report with a row of the other."""

    model: str
    dtype: str
    check: str
    tp: int

    def order(self) -> tuple:
        """TP size first: the table reads like the run."""
        return self.tp, self.model, self.dtype, self.check


@dataclass(frozen=True)
class ReportRow:
    """What diff compares of one report row."""

    status: str
    metrics: dict
    message: str


def _rows(path: str | Path) -> dict[RowKey, ReportRow]:
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"diff: cannot read {path} ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"diff: {path} is not a JSON report ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise UsageError(f"diff: {path} is not a freetoken-verify report (no results)")
    dtypes = {m.get("name"): m.get("dtype") for m in report.get("models") or []
              if isinstance(m, dict)}
    rows = {}
    for i, row in enumerate(report["results"]):
        try:
            key = RowKey(str(row["model"]), str(dtypes.get(row["model"], "")),
                         str(row["check"]), int(row["tp"]))
            rows[key] = ReportRow(str(row["status"]), dict(row.get("metrics") or {}),
                                  str(row.get("message") or ""))
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"diff: {path}: results[{i}] is not a report row") from None
    return rows


def _moved(old, new) -> bool:
    if isinstance(old, bool) or isinstance(new, bool):
        return old != new
    if not (isinstance(old, (int, float)) and isinstance(new, (int, float))):
        return False
    if not (math.isfinite(old) and math.isfinite(new)):
        return old != new
    if old == 0 or new == 0:
        return (old == 0) != (new == 0)
    ratio = abs(new) / abs(old)
    return ratio > METRIC_FACTOR or ratio < 1 / METRIC_FACTOR


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def diff_reports(old_path: str | Path, new_path: str | Path) -> tuple[list[list[str]], bool]:
    """(table rows: model, dtype, check, tp, old status, new status, what changed; whether
    a row regressed)."""
    old, new = _rows(old_path), _rows(new_path)
    table, regressed = [], False
    for key in sorted(set(old) | set(new), key=RowKey.order):
        a, b = old.get(key), new.get(key)
        before = a.status if a else "-"
        after = b.status if b else "-"
        changes = []
        if a and b:
            for name in sorted(set(a.metrics) & set(b.metrics)):
                if _moved(a.metrics[name], b.metrics[name]):
                    changes.append(f"{name} {_fmt(a.metrics[name])} -> {_fmt(b.metrics[name])}")
        if before == after and not changes:
            continue
        if b and b.status in _BAD and b.message:
            changes.append(b.message[:120])
        regressed |= before == "pass" and after in _BAD
        table.append([key.model, key.dtype, key.check, str(key.tp), before.upper(),
                      after.upper(), "; ".join(changes)])
    return table, regressed


def print_diff(old_path: str, new_path: str, echo) -> int:
    """Print the changed rows through `echo`; the exit status (see the module)."""
    table, regressed = diff_reports(old_path, new_path)
    if not table:
        echo(f"no row changed status or moved a metric by more than {METRIC_FACTOR:g}x")
        return 0
    echo(tabulate(table, headers=["model", "dtype", "check", "tp", "old", "new", "changed"],
                  tablefmt="simple", disable_numparse=True))
    echo(f"{len(table)} row(s) changed" + ("; a passing row now fails" if regressed else ""))
    return 1 if regressed else 0
