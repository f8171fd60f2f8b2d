"""Tests for freetoken_verify.report.formats: the result record, the table, the JSON report (version
2), JUnit
XML and the markdown summary."""

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
import torch

from freetoken_verify.report.formats import (
    CheckResult,
    count_line,
    junit_tree,
    markdown_summary,
    render_failures,
    render_table,
    report_dict,
    summarize,
)
from freetoken_verify.report.run_info import RunInfo

_RESULT_KEYS = {"check", "model", "tp", "status", "seconds", "placement", "metrics", "message",
                "detail"}
_REPORT_KEYS = {"version", "complete", "env", "run", "models", "results", "summary"}
_TRACEBACK = "--- rank 3 ---\nTraceback (most recent call last):\nRuntimeError: boom"


def _make_result(status: str = "pass", **overrides) -> CheckResult:
    fields = {"check": "golden", "model": "tiny-llama", "tp": 2, "status": status,
              "seconds": 1.25, "placement": "cpu-gloo",
              "metrics": {"max_abs": 2.1e-06, "top1_agree": 1.0}, "message": f"{status} note"}
    return CheckResult(**{**fields, **overrides})


def _make_results() -> list[CheckResult]:
    return [
        _make_result("pass"),
        _make_result("fail", check="shards", metrics={"mismatched": 3, "max_abs": 0.5},
                     message="layers.0.mlp.gate_up_proj rank 1: 3 / 64 mismatched"),
        _make_result("skip", check="kernels", metrics={}, message="needs CUDA"),
        _make_result("error", check="memory", tp=4, metrics={},
                     message="rank 3 raised RuntimeError: boom", detail=_TRACEBACK),
    ]


def _make_info(dtype: str = "float32", reference: str = "golden",
               faults: tuple[str, ...] = ()) -> RunInfo:
    """A run identity shaped like `freetoken_verify.report.run_info.describe_run`'s, for one
    model."""
    env = {"python": "3.11.7", "platform": "Linux", "torch": "2.13.0", "triton": None,
           "transformers": "5.24.0", "cuda": None, "nccl": None, "driver": None,
           "device": "cpu", "gpus": 0, "gpu_names": [], "cpu": "test CPU", "cpu_count": 2}
    run = {"arguments": {"models": ["tiny-llama"], "tp": [2, 4], "checks": ["golden"],
                         "faults": list(faults)},
           "argv": ["freetoken-verify"], "dtype": dtype, "device": "cpu", "reference": reference,
           "faults": list(faults), "seed": None, "started": "2026-12-01T10:00:00Z",
           "finished": None, "version": "0.1.0", "git_commit": "a" * 40, "git_dirty": False}
    source = {"path": "/models/tiny-llama", "hub_id": None, "revision": None, "snapshot": None}
    models = [{"name": "tiny-llama", "bundled": True, "dtype": dtype, "reference": reference,
               "source": source}]
    return RunInfo(env, run, models)


def _assert_strict_json(text: str):
    def reject(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=reject)


def test_status_is_validated():
    """A status outside pass/fail/skip/error is rejected at construction."""
    with pytest.raises(ValueError, match="'ok'"):
        _make_result("ok")


def test_tensor_and_numpy_scalars_become_python_numbers():
    """Metric values from torch or numpy are stored as plain Python int/float."""
    np = pytest.importorskip("numpy")
    metrics = {"a": torch.tensor(1.5), "b": np.float32(2.0), "c": np.int64(3),
               "d": {"e": torch.tensor([1, 2])}}
    result = _make_result(metrics=metrics)
    assert result.metrics == {"a": 1.5, "b": 2.0, "c": 3, "d": {"e": [1, 2]}}
    assert [type(result.metrics[k]) for k in "abc"] == [float, float, int]
    json.dumps(result.to_dict())


def test_unserialisable_metric_is_rejected_by_name():
    """A metric that cannot become JSON fails at construction, naming the metric."""
    with pytest.raises(TypeError, match="'weird'"):
        _make_result(metrics={"weird": object()})


def test_summary_and_count_line_count_errors_as_failed():
    """The summary keeps errors apart; the count line folds them into failed."""
    results = _make_results()
    assert summarize(results) == {"passed": 1, "failed": 1, "skipped": 1, "errors": 1}
    assert count_line(results) == "1 passed, 2 failed, 1 skipped"
    assert count_line([]) == "0 passed, 0 failed, 0 skipped"


def test_table_rows_statuses_and_messages():
    """Each result is a row with upper-case status; only non-pass rows show a message."""
    table = render_table(_make_results())
    lines = table.splitlines()
    assert lines[0].split() == ["model", "check", "tp", "status", "placement", "metrics",
                                "seconds", "message"]
    assert len(lines) == 2 + 4
    for status in ("PASS", "FAIL", "SKIP", "ERROR"):
        assert status in table, status
    assert "pass note" not in table
    assert "rank 3 raised RuntimeError: boom" in table and "1.2" in lines[2]


def test_table_metrics_are_compact_and_ordered():
    """Preferred metrics come first, at most five, in short e-notation or fixed point."""
    metrics = {"zeta": 1, "kl_max": 3e-12, "greedy_total": 16, "greedy_match": 16,
               "top1_agree": 1.0, "max_abs": 2.1e-06, "rel_l2": 0.0, "extra": 9}
    table = render_table([_make_result(metrics=metrics)])
    assert "max_abs=2.1e-06 rel_l2=0 top1=1.000 kl=3.0e-12 greedy=16/16" in table
    assert "zeta" not in table and "extra" not in table


def test_table_truncates_long_messages():
    """A long multi-line message becomes one line of at most 160 characters, without the
    `model tp=N:` prefix the row already says."""
    message = "tiny-llama tp=2: first line\n" + "x" * 300
    table = render_table([_make_result("fail", message=message)])
    shown = table.splitlines()[-1].split("FAIL")[1]
    assert "first line xxx" in shown and shown.rstrip().endswith("...")
    assert "tiny-llama tp=2" not in shown
    assert len(shown.split("first line", 1)[1]) + len("first line") <= 160


@pytest.mark.parametrize("width", [100, 120])
def test_table_fits_the_terminal_and_failures_follow_in_full(width):
    """Fitted to a terminal's width no table line is wider (the message, then the metrics
    cells shortened); the FAILURES section after it holds each failed or errored row's full
    message, and with verbose the failing rank's traceback."""
    results = _make_results()
    results[1] = replace(results[1], message="tiny-llama tp=2: " + "a long explanation " * 20)
    table = render_table(results, width=width)
    assert max(len(line) for line in table.splitlines()) <= width, table
    failures = render_failures(results)
    assert "FAILURES" in failures and ("a long explanation " * 20).strip() in failures
    assert "--- tiny-llama shards tp=2 FAIL (cpu-gloo) ---" in failures
    assert "--- tiny-llama memory tp=4 ERROR (cpu-gloo) ---" in failures
    assert _TRACEBACK not in failures and "run with -v" in failures
    assert _TRACEBACK in render_failures(results, verbose=True)
    assert render_failures([results[0], results[2]]) == ""


def test_json_v2_carries_identity_rows_and_tracebacks():
    """The report is strict JSON with the version-2 keys: identity sections as given, one row
    per result with the contract's keys, the failing rank's traceback on the error row only,
    and `complete` as stated."""
    results, info = _make_results(), _make_info()
    report = report_dict(results, info, complete=False)
    loaded = _assert_strict_json(json.dumps(report, allow_nan=False))
    assert set(loaded) == _REPORT_KEYS and loaded["version"] == 2, loaded.keys()
    assert loaded["complete"] is False
    assert (loaded["env"], loaded["run"], loaded["models"]) == (info.env, info.run, info.models)
    assert all(set(r) == _RESULT_KEYS for r in loaded["results"])
    assert [r["detail"] for r in loaded["results"]] == [None, None, None, _TRACEBACK]
    assert loaded["summary"] == {"passed": 1, "failed": 1, "skipped": 1, "errors": 1}


def test_json_writes_non_finite_metrics_as_strings():
    """An infinite or NaN metric is written as a string, keeping the file strict JSON."""
    result = _make_result("fail", metrics={"max_abs": math.inf, "kl_max": math.nan})
    text = json.dumps(report_dict([result], _make_info()), allow_nan=False)
    metrics = _assert_strict_json(text)["results"][0]["metrics"]
    assert metrics == {"max_abs": "inf", "kl_max": "nan"}


def _cases(root: ET.Element) -> list[ET.Element]:
    return root.findall("testsuite/testcase")


def _properties(element: ET.Element) -> dict:
    return {p.get("name"): p.get("value") for p in element.findall("properties/property")}


def test_junit_ids_carry_dtype_and_reference():
    """The same check on the same model and TP size gets a different id (suite, classname,
    name) at another dtype or against another reference: classname
    `model.dtype.tpN.placement-Ggpu`, the check as name, one suite per reference."""
    ids = {}
    for dtype, reference in (("float32", "golden"), ("bfloat16", "golden"), ("bfloat16", "hf")):
        root = junit_tree([_make_result()], _make_info(dtype, reference))
        (suite,) = root.findall("testsuite")
        (case,) = suite.findall("testcase")
        ids[dtype, reference] = (suite.get("name"), case.get("classname"), case.get("name"))
    assert ids["bfloat16", "hf"] == ("freetoken-verify.hf",
                                      "tiny-llama.bf16.tp2.cpu-gloo-0gpu", "golden")
    assert ids["float32", "golden"] == ("freetoken-verify.golden",
                                        "tiny-llama.fp32.tp2.cpu-gloo-0gpu", "golden")
    assert len(set(ids.values())) == 3, ids


def test_junit_names_survive_dots_and_slashes_and_merge_across_machines():
    """A model path or a dotted case name is one classname segment (its dots and slashes
    sanitised, the real name in a property); the same row on a machine with another GPU
    count or placement gets another id; each suite has the run's timestamp and hostname."""
    result = _make_result(model="/models/Qwen3.5-35B-A3B")
    info = _make_info()
    info.models[0]["name"] = result.model
    root = junit_tree([result], info)
    (suite,) = root.findall("testsuite")
    (case,) = suite.findall("testcase")
    assert case.get("classname") == "models_Qwen3_5-35B-A3B.fp32.tp2.cpu-gloo-0gpu"
    assert _properties(case)["model"] == "/models/Qwen3.5-35B-A3B"
    assert suite.get("timestamp") == "2026-12-01T10:00:00" and suite.get("hostname")
    info.env["gpus"] = 4
    result = replace(result, placement="cuda-nccl")
    other = junit_tree([result], info).find("testsuite/testcase").get("classname")
    assert other == "models_Qwen3_5-35B-A3B.fp32.tp2.cuda-nccl-4gpu"


def test_junit_counts_properties_and_bodies():
    """Counts add up at both levels; each testcase carries placement, seconds, dtype,
    reference and faults; a failure's body holds its message and metrics, an error's its
    message and the failing rank's traceback; a pass has no child but its properties."""
    root = junit_tree(_make_results(), _make_info("bfloat16", "hf", ("drop-allreduce",)))
    counts = {k: root.get(k) for k in ("tests", "failures", "errors", "skipped")}
    assert counts == {"tests": "4", "failures": "1", "errors": "1", "skipped": "1"}
    assert root.find("testsuite").get("tests") == "4"
    cases = _cases(root)
    assert [c.get("classname") for c in cases] == ["tiny-llama.bf16.tp2.cpu-gloo-0gpu"] * 3 + [
        "tiny-llama.bf16.tp4.cpu-gloo-0gpu"]
    assert [c.get("name") for c in cases] == ["golden", "shards", "kernels", "memory"]
    assert _properties(cases[0]) == {"model": "tiny-llama", "tp": "2", "placement": "cpu-gloo",
                                     "gpus": "0", "seconds": "1.250", "dtype": "bfloat16",
                                     "reference": "hf", "faults": "drop-allreduce"}
    assert [child.tag for child in cases[0]] == ["properties"]
    failure = cases[1].find("failure")
    assert failure.get("message").startswith("layers.0.mlp.gate_up_proj")
    body, metrics = failure.text.split("\n\nmetrics: ")
    assert body == failure.get("message") and json.loads(metrics) == {"max_abs": 0.5,
                                                                       "mismatched": 3}
    assert cases[2].find("skipped").get("message") == "needs CUDA"
    error = cases[3].find("error")
    assert error.get("message") == "rank 3 raised RuntimeError: boom"
    assert error.text == f"rank 3 raised RuntimeError: boom\n\n{_TRACEBACK}", error.text


def test_junit_survives_control_characters():
    """Terminal colour codes in a message or traceback do not make the XML unparseable."""
    result = _make_result("error", message="\x1b[31mboom\x1b[0m", detail="\x1b[1mtrace")
    root = junit_tree([result], _make_info())
    error = ET.fromstring(ET.tostring(root)).find("testsuite/testcase/error")
    assert "boom" in error.get("message") and "trace" in error.text


def test_markdown_summary_rows_and_escaping():
    """The summary heads with the count line and what ran, collapses the passing rows into
    counts per check, then a table row per result that needs attention: model, dtype label,
    reference, TP, check, status (failures in bold); a `|` in a message cannot break the
    table; every failure's message follows in full."""
    results = _make_results()
    results[1] = replace(results[1], message="a | b " + "long " * 60)
    text = markdown_summary(results, _make_info("bfloat16", "hf"), complete=False)
    lines = text.splitlines()
    assert lines[0] == "### freetoken-verify: 1 passed, 2 failed, 1 skipped (incomplete)"
    assert "dtype bfloat16" in lines[2] and "faults none" in lines[2]
    assert "Passed: golden 1 (1 models, TP 2)" in lines
    rows = [line for line in lines if line.startswith("| tiny-llama")]
    assert len(rows) == 3 and all(row.count(" | ") == 9 for row in rows), rows
    cells = [row.split(" | ") for row in rows]
    assert cells[0][1:6] == ["bf16", "hf", "2", "shards", "**FAIL**"]
    assert cells[1][5] == "SKIP" and cells[2][5] == "**ERROR**" and "a \\| b" in rows[0]
    assert "a | b " + "long " * 59 + "long" in text, "the failure's full message"
    assert markdown_summary(results, _make_info()).splitlines()[0].endswith("1 skipped")
