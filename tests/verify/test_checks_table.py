"""The one table of checks (`freetoken_verify.checks.base.CHECKS`): every name unique and
loadable, each with a one-line description, in the run order derived from what each check
needs (which the runner keeps); the shared result helper fills a row from the context."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from freetoken_verify.checks import (
    CHECK_NAMES,
    CHECKS,
    CheckSpec,
    VerifyOptions,
    available_checks,
    make_result,
)
from freetoken_verify.checks.base import CheckTableError, in_run_order
from freetoken_verify.running.runner import Plan


def test_every_registered_check_loads_its_run_function_in_table_order():
    """Names are unique and exactly the checks the design names; `available_checks` returns
    each module's `run` in table order; every description is one non-empty line."""
    assert len(set(CHECK_NAMES)) == len(CHECK_NAMES), CHECK_NAMES
    assert set(CHECK_NAMES) == {"golden", "shards", "memory", "kernels", "bisect",
                                "collectives"}
    loaded = available_checks()
    assert list(loaded) == list(CHECK_NAMES)
    for spec in CHECKS:
        assert loaded[spec.name].__module__ == f"freetoken_verify.checks.{spec.module}.check", spec
        assert spec.description.strip() and "\n" not in spec.description, spec


def test_golden_runs_before_bisect_and_memory_before_shards():
    """Order matters, and the table says so in `needs`: bisect reuses what golden recorded
    (the TP=1 activations, whether the batched generation matched), and shards compares the
    engine memory loaded under measurement. Every need runs before its check."""
    specs = {spec.name: spec for spec in CHECKS}
    assert "golden" in specs["bisect"].needs and "memory" in specs["shards"].needs
    order = list(CHECK_NAMES)
    for spec in CHECKS:
        assert all(order.index(need) < order.index(spec.name) for need in spec.needs), spec


def test_run_order_is_derived_from_needs_else_table_order():
    """A check listed before one it needs runs after it; the others keep their table
    order."""
    table = (CheckSpec("b", "b", "", needs=("a",)), CheckSpec("c", "c", ""),
             CheckSpec("a", "a", ""), CheckSpec("d", "d", "", needs=("b",)))
    assert [s.name for s in in_run_order(table)] == ["c", "a", "b", "d"]
    assert in_run_order(table[1:3]) == table[1:3]


def test_a_need_missing_from_the_table_is_refused():
    with pytest.raises(CheckTableError, match="check 'bisect' needs 'goldn', which is not in"):
        in_run_order((CheckSpec("golden", "golden", ""),
                      CheckSpec("bisect", "bisect", "", needs=("goldn",))))


def test_a_cycle_of_needs_is_refused():
    with pytest.raises(CheckTableError, match=r"'a' \(needs b\), 'b' \(needs a\) form a cycle"):
        in_run_order((CheckSpec("a", "a", "", needs=("b",)),
                      CheckSpec("b", "b", "", needs=("a",)), CheckSpec("c", "c", "")))


def test_make_result_fills_the_row_from_the_context():
    """The helper names the check, the context's model, TP size and placement, and times the
    row from `start`."""
    ctx = SimpleNamespace(case=SimpleNamespace(name="tiny-llama"), tp=2, placement="cpu-gloo")
    row = make_result("shards", ctx, time.monotonic() - 1.0, "fail", {"tensors": 3}, "why")
    assert (row.check, row.model, row.tp, row.status, row.placement, row.message) == (
        "shards", "tiny-llama", 2, "fail", "cpu-gloo", "why")
    assert row.metrics == {"tensors": 3} and 1.0 <= row.seconds < 60.0, row


def test_a_plan_runs_its_checks_in_the_tables_order_and_refuses_an_unknown_one():
    """However the caller ordered them, a plan's checks run as the table orders them; a name
    the table lacks is refused when the plan is made."""
    plan = Plan([], [1], {"shards": None, "bisect": None, "memory": None, "golden": None},
                VerifyOptions())
    assert list(plan.checks) == ["golden", "bisect", "memory", "shards"]
    with pytest.raises(ValueError, match="not in the table of checks: goldn"):
        Plan([], [1], {"goldn": None}, VerifyOptions())
