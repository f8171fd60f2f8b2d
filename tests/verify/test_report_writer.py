"""Reports written as the run goes (freetoken_verify.report.writer): a run killed between rows
leaves
valid, schema-conforming reports of what finished; writes are atomic; the job summary is
appended once, at the end; and a real run's report matches the shipped schema."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from importlib import resources

import pytest
from conftest import make_broken_checkpoint
from test_report import _make_info, _make_result

from freetoken_verify.cli import main
from freetoken_verify.report import writer as report_writer
from freetoken_verify.report.formats import junit_name
from freetoken_verify.report.writer import STEP_SUMMARY, ReportPaths, ReportWriter

# The `test` extra installs it; a GPU runner with only the runtime dependencies still collects
# this module when the gate selects its `gpu` tests, so it is skipped there, not an error.
jsonschema = pytest.importorskip("jsonschema", reason="the test extra's jsonschema is not "
                                 "installed (pip install -e .[test])")


def _schema() -> dict:
    return json.loads((resources.files("freetoken_verify") / "report" / "schema.json").read_text())


def schema_errors(report: dict, schema: dict) -> list[str]:
    """Every way `report` breaks `schema` (a JSON Schema 2020-12 validator; the schema itself
    is checked first), as `path: message` lines."""
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(report)]


def _make_paths(tmp_path) -> ReportPaths:
    return ReportPaths(str(tmp_path / "r.json"), str(tmp_path / "r.xml"), str(tmp_path / "r.md"))


def _assert_valid(report: dict) -> None:
    errors = schema_errors(report, _schema())
    assert errors == [], "\n".join(errors)


def _read(paths: ReportPaths) -> tuple[dict, ET.Element, str]:
    with open(paths.json, encoding="utf-8") as f:
        report = json.load(f)
    with open(paths.summary_md, encoding="utf-8") as f:
        markdown = f.read()
    return report, ET.parse(paths.junit).getroot(), markdown


def test_killed_run_leaves_valid_partial_reports(tmp_path, monkeypatch):
    """After 1 of 2 rows (the process killed there) every report is on disk and parses: the
    JSON is schema-valid with one row, `complete: false` and no end time, the JUnit has one
    testcase, the markdown says incomplete. `finish` completes all three with both rows."""
    monkeypatch.delenv(STEP_SUMMARY, raising=False)
    paths = _make_paths(tmp_path)
    writer = ReportWriter(_make_info(), paths).start()
    assert _read(paths)[0]["results"] == [], "the identity must be on disk before any row"
    writer.add(_make_result("pass"))
    report, junit, markdown = _read(paths)
    _assert_valid(report)
    assert report["complete"] is False and report["run"]["finished"] is None
    assert len(report["results"]) == 1 and report["summary"]["passed"] == 1
    assert junit.get("tests") == "1" and "(incomplete)" in markdown.splitlines()[0]

    writer.add(_make_result("fail", check="shards", message="rank 1: 3 / 64 mismatched"))
    writer.finish()
    report, junit, markdown = _read(paths)
    _assert_valid(report)
    assert report["complete"] is True and report["run"]["finished"] is not None
    assert [r["status"] for r in report["results"]] == ["pass", "fail"]
    assert junit.get("tests") == "2" and junit.get("failures") == "1"
    assert "incomplete" not in markdown and writer.errors == []


def test_failed_write_keeps_previous_file_and_is_reported_once(tmp_path, monkeypatch):
    """A write that fails at the final rename leaves the previous report intact and no
    temporary file behind; the report is then dropped for the run with one error line, and
    the other reports keep being written."""
    monkeypatch.delenv(STEP_SUMMARY, raising=False)
    paths = _make_paths(tmp_path)
    writer = ReportWriter(_make_info(), paths).start()
    before = open(paths.json, encoding="utf-8").read()
    real_replace = report_writer.os.replace

    def replace(src, dst):
        if str(dst) == paths.json:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(report_writer.os, "replace", replace)
    writer.add(_make_result("pass"))
    writer.add(_make_result("pass", check="shards"))
    assert open(paths.json, encoding="utf-8").read() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md", "r.xml"]
    assert writer.errors == [f"--report-json: could not write {paths.json} "
                             "(No space left on device)"]
    assert ET.parse(paths.junit).getroot().get("tests") == "2"


def test_step_summary_is_appended_once_at_the_end(tmp_path, monkeypatch):
    """With $GITHUB_STEP_SUMMARY set, nothing is appended while rows come in; `finish`
    appends the markdown summary after what earlier steps wrote."""
    step = tmp_path / "step.md"
    step.write_text("earlier step\n")
    monkeypatch.setenv(STEP_SUMMARY, str(step))
    writer = ReportWriter(_make_info(), ReportPaths()).start()
    writer.add(_make_result("pass"))
    assert step.read_text() == "earlier step\n"
    writer.finish()
    text = step.read_text()
    assert text.startswith("earlier step\n### freetoken-verify: 1 passed, 0 failed, 0 skipped")
    assert text.count("### freetoken-verify") == 1 and "Passed: golden 1 (1 models" in text



def test_real_run_reports_error_traceback_and_match_schema(capsys, golden, tmp_path,
                                                          monkeypatch):
    """A real run whose rank fails while loading: the JSON report matches the shipped schema
    and names the model's source folder; the error row and the JUnit error body carry the
    message and the rank's traceback naming the tensor; --summary-md and the job summary get
    the table."""
    step = tmp_path / "step.md"
    monkeypatch.setenv(STEP_SUMMARY, str(step))
    folder = make_broken_checkpoint(golden, tmp_path)
    paths = _make_paths(tmp_path / "reports")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(folder), "--tp", "1", "--reference", "hf", "--checks", "golden",
              "--device", "cpu", "--report-json", paths.json, "--junit-xml", paths.junit,
              "--summary-md", paths.summary_md])
    out = capsys.readouterr().out
    assert exit_info.value.code == 1, out
    report, junit, markdown = _read(paths)
    _assert_valid(report)
    assert report["complete"] is True and report["run"]["arguments"]["tp"] == [1]
    (model,) = report["models"]
    assert model["source"]["path"] == str(folder.resolve()) and model["reference"] == "hf"
    assert model["dtype"] == "float32" and model["source"]["hub_id"] is None
    (row,) = report["results"]
    assert row["status"] == "error" and "--- rank 0 ---" in row["detail"], row
    assert "model.layers.1.self_attn.k_proj.weight" in row["detail"]
    error = junit.find("testsuite/testcase/error")
    assert error.text.startswith(row["message"]) and "Traceback" in error.text
    case = junit.find("testsuite/testcase")
    assert case.get("classname") == f"{junit_name(str(folder))}.fp32.tp1.cpu-gloo-0gpu"
    assert {p.get("name"): p.get("value") for p in case.iter("property")}["model"] == \
        str(folder)
    assert "**ERROR**" in markdown and step.read_text() == markdown + "\n"


def test_schema_rejects_what_the_contract_forbids():
    """The schema check can fail: a version-1 report, a missing start time, an unknown key
    and a status outside the four are each named."""
    from freetoken_verify.report.formats import report_dict

    report = json.loads(json.dumps(report_dict([_make_result("pass")], _make_info())))
    _assert_valid(report)
    report["version"] = 1
    del report["run"]["started"]
    report["env"]["extra"] = True
    report["results"][0]["status"] = "ok"
    errors = "\n".join(schema_errors(report, _schema()))
    for needle in ("$.version: 2 was expected", "$.run: 'started' is a required property",
                   "$.env: Additional properties are not allowed ('extra' was unexpected)",
                   "$.results[0].status: 'ok' is not one of"):
        assert needle in errors, errors


def test_summary_path_is_checked_before_the_run(capsys, tmp_path):
    """--summary-md naming the JSON report's file, or a folder, is a usage error (exit 2)
    naming both options or the path, before any rank starts."""
    same = str(tmp_path / "r.json")
    for args, needle in ((["--report-json", same, "--summary-md", same],
                          "--report-json and --summary-md are the same file"),
                         (["--summary-md", str(tmp_path)], "--summary-md")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--model", "tiny-llama", "--tp", "1", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and needle in err, err
    assert not (tmp_path / "r.json").exists()


def test_a_refused_run_still_writes_its_reports(capsys, tmp_path):
    """A run refused before any rank starts (an unknown model) exits 2 with its one error
    line, and the reports it was asked for still come out: one `setup` error row carrying the
    refusal (a CI job reading the JUnit file shows a failure, not a missing file), valid
    against the schema, complete."""
    paths = _make_paths(tmp_path / "reports")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path / "nowhere"), "--tp", "1,2", "--report-json", paths.json,
              "--junit-xml", paths.junit, "--summary-md", paths.summary_md])
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2 and err.startswith("error: ") and "nowhere" in err, err
    report, junit, markdown = _read(paths)
    _assert_valid(report)
    (row,) = report["results"]
    assert (row["check"], row["status"], row["placement"], row["tp"]) == (
        "setup", "error", "none", 1), row
    assert "refused before any rank started" in row["message"] and "nowhere" in row["message"]
    assert report["complete"] is True and report["models"] == []
    assert junit.get("errors") == "1" and junit.find("testsuite/testcase/error") is not None
    assert "**ERROR**" in markdown and "nowhere" in markdown
