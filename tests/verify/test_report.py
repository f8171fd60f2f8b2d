"""Tests for verify.report: the result record, the table, the JSON contract and JUnit XML."""

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch

from verify import report
from verify.report import (
    CheckResult,
    count_line,
    environment,
    render_table,
    report_dict,
    summarize,
    write_json,
    write_junit,
)

_RESULT_KEYS = {"check", "model", "tp", "status", "seconds", "placement", "metrics", "message"}


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
                     message="rank 3 raised RuntimeError: boom"),
    ]


def _make_env() -> dict:
    return {"torch": "2.13", "triton": "absent", "transformers": "5.0", "device": "cpu",
            "gpus": 0}


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
    """A long multi-line message becomes one line of at most 160 characters."""
    message = "first line\n" + "x" * 300
    table = render_table([_make_result("fail", message=message)])
    shown = table.splitlines()[-1].split("FAIL")[1]
    assert "first line xxx" in shown and shown.rstrip().endswith("...")
    assert len(shown.split("first line", 1)[1]) + len("first line") <= 160


def test_environment_reports_versions_without_importing(monkeypatch):
    """The environment has exactly the contract keys; a missing package reads 'absent'."""
    real_version = report.metadata.version

    def fake_version(name):
        if name == "triton":
            raise report.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(report.metadata, "version", fake_version)
    env = environment("cpu", 0)
    assert set(env) == {"torch", "triton", "transformers", "device", "gpus"}
    assert env["triton"] == "absent" and env["torch"] == real_version("torch")
    with pytest.raises(ValueError, match="auto"):
        environment("auto", 0)


def test_json_matches_contract_and_round_trips(tmp_path):
    """The written JSON is strict, has exactly the contract keys, and equals report_dict."""
    results = _make_results()
    path = tmp_path / "out" / "report.json"
    write_json(path, results, _make_env())
    loaded = _assert_strict_json(path.read_text())
    assert set(loaded) == {"version", "env", "results", "summary"} and loaded["version"] == 1
    assert all(set(r) == _RESULT_KEYS for r in loaded["results"])
    assert loaded == json.loads(json.dumps(report_dict(results, _make_env())))
    assert loaded["summary"] == {"passed": 1, "failed": 1, "skipped": 1, "errors": 1}


def test_json_writes_non_finite_metrics_as_strings(tmp_path):
    """An infinite or NaN metric is written as a string, keeping the file strict JSON."""
    result = _make_result("fail", metrics={"max_abs": math.inf, "kl_max": math.nan})
    path = tmp_path / "report.json"
    write_json(path, [result], _make_env())
    metrics = _assert_strict_json(path.read_text())["results"][0]["metrics"]
    assert metrics == {"max_abs": "inf", "kl_max": "nan"}


def test_junit_counts_and_elements(tmp_path):
    """The JUnit file parses and carries one testcase per result with the right children."""
    path = tmp_path / "junit.xml"
    write_junit(path, _make_results())
    suite = ET.parse(path).getroot()
    assert suite.tag == "testsuite" and suite.get("name") == "freetoken-verify"
    counts = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")}
    assert counts == {"tests": "4", "failures": "1", "errors": "1", "skipped": "1"}
    cases = suite.findall("testcase")
    assert [c.get("classname") for c in cases] == ["tiny-llama.tp2"] * 3 + ["tiny-llama.tp4"]
    assert [c.get("name") for c in cases] == ["golden", "shards", "kernels", "memory"]
    assert list(cases[0]) == []
    failure = cases[1].find("failure")
    assert failure.get("message").startswith("layers.0.mlp.gate_up_proj")
    assert json.loads(failure.text) == {"max_abs": 0.5, "mismatched": 3}
    assert cases[2].find("skipped").get("message") == "needs CUDA"
    assert cases[3].find("error").get("message") == "rank 3 raised RuntimeError: boom"


def test_junit_survives_control_characters(tmp_path):
    """Terminal colour codes in a message do not make the XML unparseable."""
    path = tmp_path / "junit.xml"
    write_junit(path, [_make_result("error", message="\x1b[31mboom\x1b[0m")])
    error = ET.parse(path).getroot().find("testcase/error")
    assert "boom" in error.get("message")
