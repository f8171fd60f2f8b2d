"""Which rows of a plan run: `-k EXPR` over each row's model, check, TP size and dtype (pytest's
keyword expressions: `and`, `or`, `not`, parentheses, each other word matching a substring,
case-insensitively), and `--rerun-failed REPORT.json` (the rows an earlier report failed or
errored). Parsed before any rank starts; a malformed expression or report is a usage error
naming it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from freetoken_verify.errors import UsageError

_TOKEN = re.compile(r"\s*(\(|\)|[^\s()]+)")
_OPERATORS = ("and", "or", "not")
Matcher = Callable[[frozenset[str]], bool]


def row_keywords(model: str, check: str, tp: int, dtype: str) -> frozenset[str]:
    """What `-k` matches a row against: model, check, `tpN` and `tp=N`, and the dtype by
    name and short name (`bfloat16`, `bf16`)."""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    return frozenset(w.lower() for w in (model, check, f"tp{tp}", f"tp={tp}", dtype, short))


def parse_keyword(expr: str) -> Matcher:
    """A matcher for `expr`; UsageError naming the expression and what is wrong."""
    tokens = _TOKEN.findall(expr)
    if not tokens or "".join(tokens) != "".join(expr.split()):
        raise UsageError(f"-k: {expr!r} is not a keyword expression")
    pos = 0

    def fail(why: str):
        raise UsageError(f"-k: {expr!r}: {why}")

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def any_of() -> Matcher:
        left = all_of()
        while peek() == "or":
            take()
            right = all_of()
            left = (lambda a, b: lambda kw: a(kw) or b(kw))(left, right)
        return left

    def all_of() -> Matcher:
        left = negated()
        while peek() == "and":
            take()
            right = negated()
            left = (lambda a, b: lambda kw: a(kw) and b(kw))(left, right)
        return left

    def negated() -> Matcher:
        token = peek()
        if token is None:
            fail("ends where a word was expected")
        if token == "not":
            take()
            inner = negated()
            return lambda kw: not inner(kw)
        if token == "(":
            take()
            inner = any_of()
            if peek() != ")":
                fail("unbalanced parenthesis")
            take()
            return inner
        if token == ")" or token in _OPERATORS:
            fail(f"{token!r} where a word was expected")
        word = take().lower()
        return lambda kw: any(word in k for k in kw)

    matcher = any_of()
    if pos != len(tokens):
        fail(f"unexpected {tokens[pos]!r}")
    return matcher


@dataclass(frozen=True)
class FailedRows:
    """The failed and errored rows of an earlier report: (model, check, TP size) triples,
    and the run arguments it was made with."""

    rows: frozenset[tuple[str, str, int]]
    arguments: dict

    @property
    def models(self) -> list[str]:
        return sorted({m for m, _, _ in self.rows})

    @property
    def checks(self) -> list[str]:
        return sorted({c for _, c, _ in self.rows})

    @property
    def tp_sizes(self) -> list[int]:
        return sorted({t for _, _, t in self.rows})


def read_failed_rows(path: str | Path) -> FailedRows:
    """The rows of report `path` (`--report-json`) whose status is fail or error. UsageError
    naming the file when it cannot be read, is not a report, or has no such row."""
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"--rerun-failed: cannot read {path} ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--rerun-failed: {path} is not a JSON report ({e})") from None
    results = report.get("results") if isinstance(report, dict) else None
    if not isinstance(results, list):
        raise UsageError(f"--rerun-failed: {path} is not a freetoken-verify report (no results)")
    rows = set()
    for i, row in enumerate(results):
        try:
            if row["status"] in ("fail", "error"):
                rows.add((str(row["model"]), str(row["check"]), int(row["tp"])))
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"--rerun-failed: {path}: results[{i}] is not a report row "
                             "(model, check, tp, status)") from None
    if not rows:
        raise UsageError(f"--rerun-failed: {path} has no failed or errored row: nothing to run")
    arguments = (report.get("run") or {}).get("arguments") or {}
    return FailedRows(frozenset(rows), arguments if isinstance(arguments, dict) else {})


@dataclass(frozen=True)
class Selection:
    """The rows to run: those `keyword` matches and, with `only`, those listed in it."""

    keyword: str | None = None
    only: frozenset[tuple[str, str, int]] | None = None

    def __post_init__(self):
        if self.keyword is not None:
            parse_keyword(self.keyword)  # a malformed expression fails when the plan is built

    def wants(self, model: str, check: str, tp: int, dtype: str) -> bool:
        if self.only is not None and (model, check, tp) not in self.only:
            return False
        return self.keyword is None or parse_keyword(self.keyword)(
            row_keywords(model, check, tp, dtype))

    def rows(self, plan) -> Iterable[tuple]:
        """(tp, case, check name) of every row of `plan` this selection keeps, in run order."""
        for tp in plan.tp_sizes:
            for case in plan.cases:
                for name in plan.checks:
                    if self.wants(case.name, name, tp, plan.dtype_of(case)):
                        yield tp, case, name
