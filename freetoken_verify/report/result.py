"""A report's row, `CheckResult`, and the counts by status: the one record of a check's
outcome, which the checks build, the reports write and the Python API returns. Free of torch,
so `import freetoken_verify` stays light."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

STATUSES = ("pass", "fail", "skip", "error")


class FrozenDict(dict):
    """A read-only dict: a row's metrics cannot be changed after the run, yet stay a plain
    JSON value (`json.dumps` and `dataclasses.asdict` take it as the dict it is)."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("report rows are read-only")

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return FrozenDict, (dict(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


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


def json_safe(value):
    """Non-finite floats as strings: strict JSON readers (jq, browsers) reject Infinity/NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check on one model at one TP size; `status` is pass, fail, skip or
    error; `detail` is the failing rank's traceback of an errored row ("" otherwise), kept off
    the table. Read-only, its metrics too, and every field a plain JSON value
    (`json.dumps(dataclasses.asdict(result))` works): the row the reports write is the row
    `freetoken_verify.run` returns (as `freetoken_verify.Result`)."""

    check: str
    model: str
    tp: int
    status: str
    seconds: float = 0.0
    placement: str = ""
    metrics: Mapping = field(default_factory=dict)
    message: str = ""
    detail: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")
        object.__setattr__(self, "tp", int(self.tp))
        object.__setattr__(self, "seconds", float(self.seconds))
        object.__setattr__(self, "metrics", FrozenDict(
            {str(k): _plain(v, str(k)) for k, v in self.metrics.items()}))

    @property
    def ok(self) -> bool:
        """Passed or skipped."""
        return self.status in ("pass", "skip")

    def describe(self) -> str:
        """`model check tp=N STATUS: message`, the row as one line."""
        text = f"{self.model} {self.check} tp={self.tp} {self.status.upper()}"
        return f"{text}: {self.message}" if self.message else text

    def to_dict(self) -> dict:
        """The result as a strict-JSON-ready dict with exactly the contract's keys."""
        return {**json_safe(asdict(self)), "detail": self.detail or None}


def summarize(results: Iterable[CheckResult]) -> dict:
    """Count results by status: passed, failed, skipped, errors."""
    counts = dict.fromkeys(STATUSES, 0)
    for result in results:
        counts[result.status] += 1
    return {"passed": counts["pass"], "failed": counts["fail"], "skipped": counts["skip"],
            "errors": counts["error"]}
