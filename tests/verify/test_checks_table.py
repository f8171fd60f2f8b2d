"""The one table of checks (`freetoken_verify.checks.base.CHECKS`): every name unique and loadable,
in
the order the runner uses, each with a one-line description; the shared result helper fills a
row from the context."""

from __future__ import annotations

import time
from types import SimpleNamespace

from freetoken_verify.checks import CHECK_NAMES, CHECKS, available_checks, make_result


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
    """Order matters: bisect reuses the TP=1 outputs golden cached, and shards compares the
    engine memory loaded under measurement."""
    order = list(CHECK_NAMES)
    assert order.index("golden") < order.index("bisect")
    assert order.index("memory") < order.index("shards")


def test_make_result_fills_the_row_from_the_context():
    """The helper names the check, the context's model, TP size and placement, and times the
    row from `start`."""
    ctx = SimpleNamespace(case=SimpleNamespace(name="tiny-llama"), tp=2, placement="cpu-gloo")
    row = make_result("shards", ctx, time.monotonic() - 1.0, "fail", {"tensors": 3}, "why")
    assert (row.check, row.model, row.tp, row.status, row.placement, row.message) == (
        "shards", "tiny-llama", 2, "fail", "cpu-gloo", "why")
    assert row.metrics == {"tensors": 3} and 1.0 <= row.seconds < 60.0, row
