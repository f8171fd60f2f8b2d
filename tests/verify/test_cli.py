"""`freetoken-verify` end to end on the bundled cases: exit codes, the table, the count line,
the JSON and JUnit reports, and that injected TP bugs make it fail naming case, TP size and
metric."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from cli_run import assert_refused, failure_message, run_cli
from conftest import GOLDEN, make_broken_checkpoint

from freetoken_verify.errors import UsageError


def _rows(out: str, model: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(model + " ")]


def _assert_fails_naming(out: str, code: int, model: str, tp: int, where: str) -> None:
    assert code == 1, f"expected exit 1, got {code}:\n{out}"
    rows = [r for r in _rows(out, model) if r.split()[2] == str(tp)]
    assert rows, f"no table row for {model} tp={tp}:\n{out}"
    assert "FAIL" in rows[0], f"row for {model} tp={tp} is not FAIL: {rows[0]}"
    message = failure_message(out, model, rows[0].split()[1], tp)
    assert f"{model} tp={tp}" in message and where in message, (
        f"the failure does not name case, TP size and {where!r}: {message}")
    assert out.strip().splitlines()[-1].endswith("0 skipped"), "count line must come last"


def test_bundled_cases_pass_with_table_and_count_line(capsys, tmp_path):
    """Every bundled case passes every check at TP 1 and 2; one table row per case, check and
    TP size; the last line counts them; the JSON report follows the contract; JUnit parses."""
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    code, out, _ = run_cli(capsys, "--tp", "1,2", "--model", "tiny-llama", "--model", "tiny-qwen3",
                        "--model", "tiny-qwen3-moe", "--report-json", str(report),
                        "--junit-xml", str(junit))
    assert code == 0, out
    summary = json.loads(report.read_text())["summary"]
    results = json.loads(report.read_text())["results"]
    n = len(results)
    assert n == 3 * 2 * len({r["check"] for r in results}) and n >= 6, results
    assert summary["failed"] == summary["errors"] == 0 and summary["passed"] >= 6, summary
    assert out.strip().splitlines()[-1] == (
        f"{summary['passed']} passed, 0 failed, {summary['skipped']} skipped")
    for model in ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"):
        assert len(_rows(out, model)) == n // 3, f"{model}: expected {n // 3} rows\n{out}"
    _assert_report_contract(json.loads(report.read_text()), expected_results=n)
    suite = ET.parse(junit).getroot()
    assert suite.get("tests") == str(n) and suite.get("failures") == "0", ET.tostring(suite)


def _assert_report_contract(report: dict, expected_results: int) -> None:
    assert set(report) == {"version", "complete", "env", "run", "models", "results",
                           "summary"}, report.keys()
    assert report["version"] == 2 and report["complete"] is True
    assert {"torch", "triton", "transformers", "device", "gpus"} <= set(report["env"])
    assert report["env"]["device"] in ("cpu", "cuda") and isinstance(report["env"]["gpus"], int)
    assert len(report["results"]) == expected_results
    for r in report["results"]:
        assert set(r) == {"check", "model", "tp", "status", "seconds", "placement", "metrics",
                          "message", "detail"}, r.keys()
        assert r["status"] in ("pass", "fail", "skip", "error")
        assert r["placement"] in ("cpu-gloo", "cuda-nccl", "cuda-shared-gloo")
        assert isinstance(r["tp"], int) and isinstance(r["seconds"], float)
        if r["check"] == "golden":
            assert {"max_abs", "rel_l2", "top1_agree", "top5_overlap", "kl_mean", "kl_max",
                    "greedy_match"} <= set(r["metrics"]), r["metrics"].keys()
    assert set(report["summary"]) == {"passed", "failed", "skipped", "errors"}
    assert sum(report["summary"].values()) == expected_results


@pytest.mark.parametrize("fault, model, tp, module", [
    ("plain-chunk-gate-up", "tiny-qwen3", 2, "prefill/model.layers.0.mlp.gate_up_proj"),
    ("drop-allreduce", "tiny-llama", 2, "prefill/model.layers.0.self_attn.o_proj"),
    ("kv-head-wrong-rank", "tiny-qwen3-moe", 4, "prefill/model.layers.0.self_attn.qkv_proj"),
])
def test_injected_tp_bug_fails_naming_case_tp_and_module(capsys, tmp_path, fault, model, tp,
                                                         module):
    """Each canonical TP bug, injected into the ranks, turns golden red at the TP size where
    it bites (TP=1 stays green): exit 1, the row names the case, the TP size and the first
    divergent module; the JSON message keeps the symptom (the prefill logits)."""
    report = tmp_path / "r.json"
    code, out, _ = run_cli(capsys, "--model", model, "--tp", f"1,{tp}", "--fault", fault,
                        "--checks", "golden", "--report-json", str(report))
    _assert_fails_naming(out, code, model, tp, f"first divergence: {module} ")
    results = {r["tp"]: r for r in json.loads(report.read_text())["results"]}
    assert results[1]["status"] == "pass", f"TP=1 must be unaffected by {fault}"
    assert results[tp]["metrics"]["top1_agree"] < 1.0, results[tp]["metrics"]
    assert "prefill logits" in results[tp]["message"], results[tp]["message"]



def test_rank_failure_is_an_error_naming_rank_and_tensor(capsys, golden, tmp_path):
    """A rank that raises while loading gives an ERROR row naming the rank and the tensor, the
    rank traceback with -v, and exit 1 — not a hang or a bare traceback."""
    folder = make_broken_checkpoint(golden, tmp_path)
    code, out, _ = run_cli(capsys, "--model", str(folder), "--tp", "2", "--reference", "hf",
                        "--checks", "golden", "-v")
    assert code == 1, out
    row = _rows(out, str(folder))[0]
    assert "ERROR" in row and "rank " in row, row
    assert "model.layers.1.self_attn.k_proj.weight" in out, "the failing tensor must be named"
    assert "Traceback" in out, "-v must print the rank traceback"
    assert out.strip().splitlines()[-1] == "0 passed, 1 failed, 0 skipped"


@pytest.mark.parametrize("args, needle", [
    (["--model", "tiny-nonexistent"], "tiny-nonexistent: no such checkpoint folder"),
    (["--model", "/nonexistent/folder"], "no such checkpoint folder"),
    (["--model", "someorg/absent-model"], "not in the local Hugging Face cache"),
    (["--tp", "0"], "--tp: '0' is not a TP size"),
    (["--tp", "1,3", "--model", "tiny-llama"],
     "tiny-llama: num_attention_heads=8 cannot be split across tp_size=3"),
    (["--checks", "golden,nonsense"], "unknown check 'nonsense'"),
    (["--model", "tiny-llama", "--num-layers", "9"], "num_layers=9 outside 1..2"),
])
def test_bad_input_exits_2_with_one_line(capsys, args, needle, monkeypatch, tmp_path):
    """Bad input is refused before any rank starts: exit 2 and one line naming the problem."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code, out, err = run_cli(capsys, *args)
    assert code == 2, f"expected exit 2 for {args}, got {code}\n{out}{err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], f"expected one line with {needle!r}: {err!r}"
    assert "Traceback" not in out + err


def test_num_layers_truncates_engine_and_hf_reference(capsys, tmp_path):
    """`--num-layers 1` runs the first decoder layer only, in the engine and in the live HF
    reference alike, so golden passes; the stored full-depth golden is refused for it."""
    report = tmp_path / "r.json"
    code, out, _ = run_cli(capsys, "--model", "tiny-qwen3-moe", "--tp", "2", "--num-layers", "1",
                        "--checks", "golden", "--report-json", str(report))
    assert code == 0, out
    truncated = json.loads(report.read_text())["results"][0]
    assert truncated["status"] == "pass" and truncated["metrics"]["greedy_match"] > 0, truncated
    code, out, _ = run_cli(capsys, "--model", "tiny-qwen3-moe", "--tp", "2", "--num-layers", "1",
                        "--reference", "golden")
    assert code == 2, "a stored full-depth golden cannot serve a truncated model"


def test_nvfp4_load_bug_fails_golden_on_the_nvfp4_case(capsys):
    """Swapping each NVFP4 expert's gate and up global scales at load turns golden red on
    tiny-qwen3.5-moe-nvfp4, naming the case, the TP size and the routed experts (the first
    module bisect finds diverging from HF on the case's dequantized twin)."""
    code, out, _ = run_cli(capsys, "--model", "tiny-qwen3.5-moe-nvfp4", "--tp", "2", "--checks",
                        "golden", "--inject", "nvfp4-load-globals-swapped")
    _assert_fails_naming(out, code, "tiny-qwen3.5-moe-nvfp4", 2,
                         "first divergence: prefill/model.layers.0.mlp.experts")


def test_bf16_against_stored_golden_uses_the_stored_baseline(capsys, tmp_path):
    """In bf16 the stored golden brings HF's own bf16 error (meta.json `baselines`), so the
    numerically sensitive qwen3.5 cases pass without a live HF run; the widened bounds still
    fail a real TP bug."""
    report = tmp_path / "r.json"
    code, out, _ = run_cli(capsys, "--model", "tiny-qwen3.5-moe-nvfp4,tiny-qwen3.5-moe", "--tp",
                        "2", "--dtype", "bfloat16", "--checks", "golden", "--report-json",
                        str(report))
    assert code == 0, out
    meta = json.loads((GOLDEN / "tiny-qwen3.5-moe-nvfp4" / "meta.json").read_text())
    stored = max(m["rel_l2"] for m in meta["baselines"]["bfloat16"])
    results = {r["model"]: r for r in json.loads(report.read_text())["results"]}
    assert results["tiny-qwen3.5-moe-nvfp4"]["metrics"]["hf_self_rel_l2"] == stored
    code, out, _ = run_cli(capsys, "--model", "tiny-qwen3.5-moe", "--tp", "2", "--dtype",
                        "bfloat16", "--checks", "golden", "--inject", "plain-chunk-gdn-qkv")
    _assert_fails_naming(out, code, "tiny-qwen3.5-moe", 2, "model.layers.0.linear_attn.in_proj")


def test_version_prints_the_package_version(capsys):
    """`--version` prints the installed package's version (from its metadata) and the commit
    of the code (this checkout's HEAD), and exits 0."""
    from importlib import metadata

    from freetoken.version import git_state

    code, out, _ = run_cli(capsys, "--version")
    head = git_state()[0]
    assert code == 0 and out.startswith(f"freetoken-verify {metadata.version('freetoken')} "
                                        f"(commit {head[:12]}"), out


def test_dtype_aliases_are_the_names_reports_use(capsys):
    """`--dtype bf16` is bfloat16 (reports label it bf16), `fp32` float32; the engine's and
    the harness's alias tables agree; an unknown dtype lists the names and aliases."""
    from freetoken.engine.core import DTYPE_ALIASES as ENGINE
    from freetoken_verify.running.options import DTYPE_ALIASES as HARNESS
    from freetoken_verify.running.plan import build_plan

    assert ENGINE == HARNESS
    assert build_plan(models=["tiny-llama"], tp=[1], dtype="bf16").options.dtype == "bfloat16"
    code, out, _ = run_cli(capsys, "--model", "tiny-llama", "--tp", "1", "--dtype", "fp32",
                           "--dry-run")
    assert code == 0 and "tiny-llama golden tp=1 float32" in out, out
    with pytest.raises(UsageError, match=r"dtype: 'f8' is not one of auto, float32, bfloat16, "
                                         r"float16 or the aliases fp32 \(float32\)"):
        build_plan(models=["tiny-llama"], tp=[1], dtype="f8")


def test_list_names_every_case_check_and_fault_with_a_description(capsys):
    """`--list` exits 0 and prints one `name  description` line for every bundled case, every
    check (in run order) and every fault, each description non-empty."""
    from freetoken_verify.cases.catalogue import CASES
    from freetoken_verify.checks import CHECK_NAMES
    from freetoken_verify.faults import FAULTS

    code, out, _ = run_cli(capsys, "--list")
    assert code == 0, out
    described = {}
    for line in out.splitlines():
        if line.startswith("  "):
            name, _, description = line.strip().partition(" ")
            described[name] = description.strip()
    for name in [*CASES, *CHECK_NAMES, *FAULTS]:
        assert described.get(name), f"{name} missing or without a description:\n{out}"
    listed_checks = [n for n in described if n in CHECK_NAMES]
    assert listed_checks == list(CHECK_NAMES), listed_checks


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_documents_options_examples_and_exit_codes(capsys, flag):
    """`-h` and `--help` exit 0 and show every option with help text, the choices and
    defaults, the check names, an examples section and the four exit codes."""
    from freetoken_verify.checks import CHECK_NAMES
    from freetoken_verify.cli import verify

    code, out, _ = run_cli(capsys, flag)
    assert code == 0, out
    text = " ".join(out.split())
    for param in verify.params:
        assert param.help, f"{param.opts} has no help text"
        assert param.opts[-1] in out, f"{param.opts} not in --help"
    for needle in ("[auto|cpu|cuda]", "[default: 1,2]", "[default: 600.0]", "Examples:",
                   "Exit status:", ", ".join(CHECK_NAMES)):
        assert needle in text, f"{needle!r} missing from --help"
    for code_line in ("0 every check passed", "1 a check failed", "2 bad usage", "130 interrupted"):
        assert code_line in text, f"{code_line!r} missing from --help"


def test_unknown_fault_is_one_line_exit_2(capsys):
    """An unknown `--inject` name is refused before any rank starts, pointing at `--list`."""
    code, out, err = run_cli(capsys, "--model", "tiny-llama", "--inject", "no-such-fault")
    assert code == 2 and err.startswith("error: unknown fault 'no-such-fault'"), err
    assert "--list" in err and len(err.strip().splitlines()) == 1, err


def test_interrupt_before_the_run_exits_130(capsys, monkeypatch):
    """Ctrl-C while the command is still parsing (click turns it into Abort) exits 130 like
    Ctrl-C during the run (`test_signals.py`), not 1."""
    import freetoken_verify.cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(freetoken_verify.cli, "parse_tp", interrupted)
    code, _, err = run_cli(capsys, "--model", "tiny-llama")
    assert code == 130 and "interrupted" in err, (code, err)


def test_cli_and_main_do_not_import_each_other():
    """The command line is a layer over `freetoken_verify.running.plan`: main imports nothing from
    cli, and cli
    imports no private name of main (the former cycle)."""
    import ast
    from pathlib import Path

    def imports(module: str) -> list[tuple[str, str]]:
        tree = ast.parse(Path(__file__).resolve().parents[2].joinpath(
            "freetoken_verify", f"{module}.py").read_text())
        return [(node.module, alias.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for alias in node.names]

    plan_imports = imports("running/plan")
    assert not [m for m, _ in plan_imports if m == "freetoken_verify.cli"], plan_imports
    private = [(m, n) for m, n in imports("cli")
               if m == "freetoken_verify.running.plan" and n.startswith("_")]
    assert not private, private


def _make_rows(*statuses: str) -> list:
    from freetoken_verify.report.formats import CheckResult

    return [CheckResult("golden", "tiny-llama", 1, s) for s in statuses]


def test_exit_status_refuses_a_run_that_verified_nothing():
    """A failed or errored row exits 1; a run whose every row was skipped (or that has no
    row) exits 1 too unless skips are allowed: nothing verified is not a green run."""
    from freetoken_verify.running.plan import exit_status

    assert exit_status(_make_rows("pass", "skip")) == 0
    assert exit_status(_make_rows("pass", "fail")) == 1
    assert exit_status(_make_rows("error")) == 1
    assert exit_status(_make_rows("skip", "skip")) == 1
    assert exit_status([]) == 1
    assert exit_status(_make_rows("skip", "skip"), allow_skips=True) == 0
    assert exit_status(_make_rows("skip", "error"), allow_skips=True) == 1


def test_an_all_skipped_run_exits_1_naming_why(capsys, monkeypatch):
    """Through the command line: every row skipped gives exit 1, an `error:` line saying that
    nothing was verified, and the count line last; `--allow-skips` turns it into exit 0."""
    import freetoken_verify.running.plan as plan_module

    monkeypatch.setattr(plan_module, "run_plan",
                        lambda plan, progress, on_result: _make_rows("skip", "skip"))
    code, out, err = run_cli(capsys, "--model", "tiny-llama", "--tp", "1", "--checks", "kernels")
    assert code == 1 and "nothing was verified" in err, (code, err)
    assert out.strip().splitlines()[-1] == "0 passed, 0 failed, 2 skipped", out
    code, out, err = run_cli(capsys, "--model", "tiny-llama", "--tp", "1", "--checks", "kernels",
                             "--allow-skips")
    assert code == 0 and "nothing was verified" not in err, (code, err)


def test_catalogue_run_refuses_unknown_faults_and_has_help(capsys):
    """`python -m freetoken_verify.running.catalogue_run` with a misspelt fault exits 2 naming
    it before anything runs (it printed `0 passed, 0 failed` and exited 0); `--help` prints
    the usage and exits 0 without running an entry."""
    from freetoken_verify.running.catalogue_run import main as catalogue_main

    assert catalogue_main(["drop-allreduc"]) == 2
    out, err = capsys.readouterr()
    assert "unknown fault 'drop-allreduc'" in err and "passed" not in out, (out, err)
    assert catalogue_main(["--help"]) == 0
    out, _ = capsys.readouterr()
    assert "Usage:" in out and "[FAULT]..." in out and " passed, " not in out, out


def test_seed_past_the_engine_range_exits_2(capsys):
    """`--seed 2**64` is refused by the command line in one line, before any rank starts (it
    overflowed on a rank: `Overflow when unpacking long long`, exit 1)."""
    assert_refused(capsys, ["--model", "tiny-llama", "--tp", "2", "--seed", str(2**64)],
                   "--seed")
