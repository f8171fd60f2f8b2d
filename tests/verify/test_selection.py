"""Choosing rows and comparing runs: `-k EXPR`, `-x` / `--maxfail`, `--rerun-failed
REPORT.json`, `--dry-run`, the kernel matrix left out where nothing can affect it, and
`freetoken-verify diff OLD.json NEW.json`."""

from __future__ import annotations

import json

import pytest
from cli_run import assert_refused, run_cli

from freetoken_verify.errors import UsageError
from freetoken_verify.running.select import parse_keyword, read_failed_rows, row_keywords


@pytest.mark.parametrize("expr, hits", [
    ("llama", {"tiny-llama golden 1", "tiny-llama shards 2"}),
    ("golden and tp2", {"tiny-qwen3.5-moe golden 2"}),
    ("qwen3 or shards", {"tiny-qwen3.5-moe golden 2", "tiny-llama shards 2"}),
    ("not golden", {"tiny-llama shards 2"}),
    ("(llama or moe) and not (tp1 or shards)", {"tiny-qwen3.5-moe golden 2"}),
    ("TP=2 and FP32", {"tiny-llama shards 2", "tiny-qwen3.5-moe golden 2"}),
])
def test_keyword_expressions_match_rows_like_pytest(expr, hits):
    """Words match substrings of model, check, tpN / tp=N and dtype (and its short name),
    case-insensitively; and / or / not / parentheses combine them."""
    rows = [("tiny-llama", "golden", 1), ("tiny-llama", "shards", 2),
            ("tiny-qwen3.5-moe", "golden", 2)]
    match = parse_keyword(expr)
    got = {f"{m} {c} {t}" for m, c, t in rows if match(row_keywords(m, c, t, "float32"))}
    assert got == hits


@pytest.mark.parametrize("expr", ["", "golden and", "(golden", "golden)", "and golden",
                                  "not", "golden shards"])
def test_malformed_keyword_expressions_are_usage_errors(expr):
    with pytest.raises(UsageError, match="-k: "):
        parse_keyword(expr)


def test_dry_run_lists_the_selected_rows_without_ranks(capsys):
    """--dry-run prints one line per planned row (model, check, TP, dtype, placement) and
    their count, and exits 0 without starting a rank; -k narrows the rows; a -k that matches
    nothing is a usage error."""
    code, out, err = run_cli(capsys, "--dry-run", "--tp", "1,2", "-k",
                             "llama and (golden or shards)", "--dtype", "bf16")
    assert code == 0 and "starting" not in err, out + err
    assert out.splitlines()[1:] == [
        "tiny-llama golden tp=1 bfloat16 cpu-gloo", "tiny-llama shards tp=1 bfloat16 cpu-gloo",
        "tiny-llama golden tp=2 bfloat16 cpu-gloo", "tiny-llama shards tp=2 bfloat16 cpu-gloo",
        "4 row(s) planned"], out
    assert out.startswith("note: kernels: the quantized GEMMs only"), out
    assert_refused(capsys, ["--dry-run", "-k", "no-such-model"], "no row is selected")
    code, out, _ = run_cli(capsys, "--collect-only", "--checks", "kernels", "--tp", "1",
                           "--model", "tiny-llama")
    assert code == 0 and out.splitlines() == ["tiny-llama kernels tp=1 float32 cpu-gloo",
                                              "1 row(s) planned"], out


def test_exitfirst_rerun_failed_and_diff(capsys, tmp_path):
    """With a fault that fails golden at TP 2, -x stops at the first failed row (later rows
    not run); --rerun-failed runs exactly that row again, with the earlier run's fault; `diff`
    of a clean run against it names the row that now fails (exit 1) and the reverse exits 0."""
    failed, clean = tmp_path / "failed.json", tmp_path / "clean.json"
    code, out, err = run_cli(capsys, "--model", "tiny-llama", "--tp", "1,2", "--checks",
                             "shards,golden", "--fault", "drop-allreduce", "-x",
                             "--report-json", str(failed))
    assert code == 1, out + err
    rows = json.loads(failed.read_text())["results"]
    assert [(r["check"], r["tp"], r["status"]) for r in rows] == [
        ("golden", 1, "pass"), ("shards", 1, "pass"), ("golden", 2, "fail")], rows
    assert "stopping after 1 failed row(s)" in err and "1 row(s) not run" in err, err
    assert "FAILURES" in out and "--- tiny-llama golden tp=2 FAIL" in out, out

    assert read_failed_rows(failed).rows == {("tiny-llama", "golden", 2)}
    code, out, err = run_cli(capsys, "--rerun-failed", str(failed), "--dry-run")
    assert code == 0 and out.splitlines() == ["tiny-llama golden tp=2 float32 cpu-gloo",
                                              "1 row(s) planned"], out
    code, out, err = run_cli(capsys, "--rerun-failed", str(failed), "--report-json", str(clean),
                             "--no-bitwise")
    assert code == 1 and "injected faults: drop-allreduce" in err, out + err
    code, out, err = run_cli(capsys, "--rerun-failed", str(failed), "--fault", "", "--tp", "2")
    assert code == 2, "an empty --fault is refused, not read as 'the report's faults'"

    code, out, err = run_cli(capsys, "--model", "tiny-llama", "--tp", "2", "--checks", "golden",
                             "--report-json", str(clean))
    assert code == 0, out + err
    code, out, _ = run_cli(capsys, "diff", str(clean), str(failed))
    assert code == 1 and "tiny-llama  float32  golden   2     PASS   FAIL" in out, out
    assert "a passing row now fails" in out and "max_abs" in out, out
    code, out, _ = run_cli(capsys, "diff", str(failed), str(clean))
    assert code == 0 and "FAIL   PASS" in out, out
    code, out, _ = run_cli(capsys, "diff", str(clean), str(clean))
    assert code == 0 and out.startswith("no row changed"), out
    assert_refused(capsys, ["diff", str(tmp_path / "missing.json"), str(clean)],
                   "diff: cannot read", "missing.json")
    assert_refused(capsys, ["--rerun-failed", str(clean)], "has no failed or errored row")
