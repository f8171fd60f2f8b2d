"""The Python API (`freetoken_verify.run` -> `Report`) and the pytest plugin (fixture
`freetoken_verify`, markers `gpu` / `multi_gpu(n)`), used as a user would: from this separate
test file and from a user-style test file run by a pytest subprocess. Bad input raises the
typed `freetoken_verify.errors`, never click's exceptions."""

from __future__ import annotations

import copy as copy_module
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest

import freetoken_verify as verify
from freetoken_verify.errors import InputError, UsageError
from freetoken_verify.pytest_plugin import cuda_device_count

ROOT = Path(__file__).resolve().parents[2]


def _make_result(status: str, message: str = "", check: str = "golden",
                 detail: str = "") -> verify.Result:
    return verify.Result(check, "tiny-llama", 2, status, 0.5, "cpu-gloo", {"max_abs": 0.0},
                         message, detail)


def _assert_typed_error(kind: type, needle: str, **kwargs) -> None:
    with pytest.raises(kind) as info:
        verify.run(**kwargs)
    assert isinstance(info.value, ValueError), "API errors must be ValueErrors"
    assert not isinstance(info.value, click.ClickException), "no click errors from the API"
    assert needle in str(info.value), f"{needle!r} not in {info.value}"
    assert "\n" not in str(info.value), f"one line: {info.value!r}"


def test_report_ok_summary_and_assert_ok_from_rows():
    """`ok` is false exactly when a row failed or errored; `summary` counts by status with the
    JSON report's keys; `assert_ok` names every failing row with its message and no passing
    one; reports and rows are frozen."""
    rows = (_make_result("pass"), _make_result("skip", "already run", "kernels"),
            _make_result("fail", "tiny-llama tp=2: prefill logits rel_l2=0.3"),
            _make_result("error", "tiny-llama tp=2: rank 1 raised", "shards"))
    bad = verify.Report(rows)
    assert not bad.ok and verify.Report(rows[:2]).ok and verify.Report(()).ok
    assert bad.summary == {"passed": 1, "failed": 1, "skipped": 1, "errors": 1}
    assert bad.failures == rows[2:]
    with pytest.raises(AssertionError) as info:
        bad.assert_ok()
    text = str(info.value)
    assert "2 of 4" in text and "prefill logits rel_l2=0.3" in text and "rank 1 raised" in text
    assert "kernels" not in text, "passing and skipped rows are not failures"
    verify.Report(rows[:2]).assert_ok()
    with pytest.raises(dataclasses.FrozenInstanceError):
        bad.results = ()
    with pytest.raises(TypeError):
        rows[0].metrics["max_abs"] = 1.0
    with pytest.raises(TypeError):
        rows[0].metrics.update(max_abs=1.0)


def test_report_is_plain_json_and_copies():
    """Every field of a report is a plain JSON value: a row's metrics, a whole row and the
    whole report go through `json.dumps` (the metrics were a mappingproxy, which it refused);
    rows survive pickle and deepcopy still read-only; an errored row's traceback is its
    `detail`, and `details` indexes them by (model, check, tp)."""
    rows = (_make_result("pass"), _make_result("error", "rank 1 raised", "shards",
                                               detail="--- rank 1 ---\nTraceback ..."))
    report = verify.Report(rows)
    assert json.loads(json.dumps(rows[0].metrics)) == {"max_abs": 0.0}
    document = json.loads(json.dumps(dataclasses.asdict(report)))
    assert document["results"][1]["detail"].startswith("--- rank 1"), document
    assert report.details == {("tiny-llama", "shards", 2): "--- rank 1 ---\nTraceback ..."}
    for copy in (pickle.loads(pickle.dumps(report)), copy_module.deepcopy(report)):
        assert copy == report
        with pytest.raises(TypeError):
            copy.results[0].metrics["max_abs"] = 2.0


def test_run_shards_on_tiny_llama_passes():
    """`verify.run` on the bundled tiny-llama at TP=1 with the shards check returns one
    passing row carrying the check's metrics, and reports progress lines per step."""
    lines: list[str] = []
    report = verify.run(models=["tiny-llama"], tp=[1], checks=["shards"], device="cpu",
                        progress=lines.append)
    assert [(r.model, r.check, r.tp, r.status) for r in report.results] == [
        ("tiny-llama", "shards", 1, "pass")], report
    assert report.ok and report.summary["passed"] == 1 and report.results[0].metrics
    assert report.results[0].placement == "cpu-gloo"
    assert "[tp=1] tiny-llama shards ..." in lines, lines
    assert any(line.startswith("[1/1] tiny-llama shards tp=1: PASS") for line in lines), lines
    report.assert_ok()


def test_run_with_injected_fault_fails_and_assert_ok_names_the_row():
    """With `shard-views` injected the shards row fails, `ok` is false and `assert_ok`
    raises naming the model, the check and why (a view)."""
    report = verify.run(models=["tiny-llama"], tp=1, checks=["shards"], device="cpu",
                        faults=["shard-views"])
    assert not report.ok and report.results[0].status == "fail", report
    with pytest.raises(AssertionError, match=r"tiny-llama shards tp=1 FAIL: .*view"):
        report.assert_ok()


@pytest.mark.parametrize("kind, needle, kwargs", [
    (UsageError, "unknown check 'nonsense'", {"checks": ["golden", "nonsense"]}),
    (UsageError, "unknown fault 'nonsense'", {"faults": ["nonsense"]}),
    (UsageError, "tp: 0 is not a positive integer", {"tp": [0]}),
    (UsageError, "tp: '2' is not a positive integer", {"tp": ["2"]}),
    (UsageError, "tp: no TP sizes given", {"tp": []}),
    (UsageError, "device: 'gpu' is not one of auto, cpu, cuda", {"device": "gpu"}),
    (UsageError, "dtype: 'fp8'", {"dtype": "fp8"}),
    (UsageError, "reference: 'live'", {"reference": "live"}),
    (UsageError, "num_layers: 0", {"num_layers": 0}),
    (UsageError, "timeout: nan", {"timeout": float("nan")}),
    (UsageError, "models: empty", {"models": [""]}),
    (InputError, "tiny-nonexistent: no such checkpoint folder", {"models": ["tiny-nonexistent"]}),
    (InputError, "tiny-llama: num_attention_heads=8 cannot be split across tp_size=3",
     {"models": ["tiny-llama"], "tp": [1, 3]}),
    (InputError, "tiny-llama: --reference golden needs a bundled case at full depth",
     {"models": ["tiny-llama"], "reference": "golden", "num_layers": 1}),
])
def test_bad_input_raises_typed_errors(kind, needle, kwargs):
    """Each malformed or unverifiable argument raises its typed error (a ValueError, not a
    click exception) with one line naming it, before any rank starts."""
    _assert_typed_error(kind, needle, **{"models": ["tiny-llama"], "device": "cpu", **kwargs})


def test_unknown_option_is_a_type_error_naming_it():
    """`run` takes the command line's options by name; any other keyword is refused as Python
    refuses an unknown keyword, naming it, before any rank starts."""
    with pytest.raises(TypeError, match="unexpected option 'dtypes'"):
        verify.run(models=["tiny-llama"], tp=[1], device="cpu", dtypes="float32")


def test_plan_sorts_tp_sizes_and_keeps_check_order():
    """build_plan takes typed values: TP sizes deduplicated and ascending, checks in the
    table's run order whatever order they were asked in."""
    from freetoken_verify.checks.base import CHECK_NAMES
    from freetoken_verify.running.plan import build_plan

    plan = build_plan(models=["tiny-llama"], tp=[2, 1, 2], checks=["shards", "golden"],
                      device="cpu")
    assert plan.tp_sizes == [1, 2]
    assert list(plan.checks) == [n for n in CHECK_NAMES if n in ("shards", "golden")]
    assert [c.name for c in plan.cases] == ["tiny-llama"]


_USER_TESTS = '''
import pytest


def test_tiny_llama_shards(freetoken_verify):
    report = freetoken_verify(model="tiny-llama", tp=[1], checks=["shards"], device="cpu")
    report.assert_ok()
    assert [r.status for r in report.results] == ["pass"]


def test_injected_fault_fails(freetoken_verify):
    report = freetoken_verify(models="tiny-llama", tp=[1], checks=["shards"], device="cpu",
                              faults=["shard-views"])
    report.assert_ok()


@pytest.mark.gpu
def test_on_a_gpu():
    pass


@pytest.mark.multi_gpu(1024)
def test_on_many_gpus():
    pass
'''


def _line_of(function: str) -> int:
    """The 1-based line of `def function` in the user's test file (pytest reports a skip
    marker at the line of the decorator: the one above)."""
    lines = textwrap.dedent(_USER_TESTS).splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith(f"def {function}("))


def _make_user_project(tmp_path: Path) -> Path:
    project = tmp_path / "user-project"
    project.mkdir()
    (project / "test_model.py").write_text(textwrap.dedent(_USER_TESTS))
    return project


def test_plugin_from_a_user_test_file(tmp_path):
    """A user's own test file, run by pytest with the plugin (`-p freetoken_verify.pytest_plugin`)
    outside this repository: the fixture runs a passing check, a failing one fails its test
    with the row in the assertion message, and `gpu` / `multi_gpu(1024)` skip with reasons
    (no CPU machine has 1024 GPUs)."""
    project = _make_user_project(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "freetoken_verify.pytest_plugin",
                           "-q", "-rs", "-p", "no:cacheprovider", "test_model.py"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"one test must fail (exit 1):\n{out}"
    gpus = cuda_device_count()
    counts = "1 failed, 2 passed, 1 skipped" if gpus else "1 failed, 1 passed, 2 skipped"
    assert counts in out, out
    assert "tiny-llama shards tp=1 FAIL" in out, "the failing row must be in the report"
    # Skips are reported at the test's own line, not at the plugin.
    assert (f"test_model.py:{_line_of('test_on_many_gpus') - 1}: needs 1024 CUDA device(s), "
            f"found {gpus or 'no'} CUDA device(s)") in out, out
    assert "pytest_plugin.py" not in out, out
    if not gpus:
        assert (f"test_model.py:{_line_of('test_on_a_gpu') - 1}: needs 1 CUDA device(s), "
                "found no CUDA device(s)") in out, out


def test_require_gpus_turns_missing_gpus_into_failures(tmp_path):
    """With --require-gpus (what the GPU gate passes), the user's `gpu` and
    `multi_gpu(1024)` tests fail, each at its own line, instead of skipping: a gate whose
    runner lost its GPUs must not record a green kernel run."""
    project = _make_user_project(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "freetoken_verify.pytest_plugin",
                           "-q", "-p", "no:cacheprovider", "--require-gpus", "-k",
                           "test_on_", "test_model.py"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    gpus = cuda_device_count()
    assert proc.returncode == 1 and ("1 passed, 1 error" if gpus else "2 errors") in out, out
    assert "ERROR at setup of test_on_many_gpus" in out, out
    assert "--require-gpus: needs 1024 CUDA device(s)" in out, out


def test_a_project_with_its_own_verify_module_runs_pytest(tmp_path):
    """With FreeToken installed its pytest plugin loads in every pytest session (the `pytest11`
    entry point); a user project that has its own `verify.py` still runs its tests. Under the
    harness's former top-level name `verify`, the plugin import failed with `'verify' is not a
    package` and pytest exited 3."""
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="pytest11")}
    assert plugins.get("freetoken_verify.pytest_plugin") == "freetoken_verify.pytest_plugin", (
        f"the installed plugin entry point: {plugins}")
    project = tmp_path / "project"
    project.mkdir()
    (project / "verify.py").write_text("def check(x):\n    return x > 0\n")
    (project / "test_own.py").write_text("from verify import check\n\n\n"
                                         "def test_check():\n    assert check(1)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                          cwd=project, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in out, out[-3000:]


def test_run_without_the_main_guard_is_one_error(tmp_path):
    """`freetoken_verify.run` at the top level of a script (no `__main__` guard) raises one
    MainModuleError naming the guard instead of one ERROR row per check, each retrying a
    start that fails again."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import freetoken_verify
        from freetoken.distributed import MainModuleError
        try:
            freetoken_verify.run(models=["tiny-llama"], tp=[2], checks=["golden", "shards"],
                                 device="cpu")
        except MainModuleError as e:
            print("MainModuleError:", e, flush=True)
        else:
            print("no error", flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert out.count("MainModuleError:") == 1 and "__main__" in out, out[-3000:]
    assert "ERROR" not in proc.stdout, out[-3000:]


def test_seeds_past_what_the_ranks_take_are_refused_in_the_parent():
    """A seed the engine's derived seeds (seed + offsets) would carry past 2**63 is refused
    before any rank starts, by the API as by the command line's range."""
    from freetoken.engine.sequence import SEED_LIMIT
    from freetoken_verify.running.options import MAX_SEED

    assert MAX_SEED + 4096 == SEED_LIMIT, "the harness's seed bound follows the engine's"
    _assert_typed_error(UsageError, "seed", models=["tiny-llama"], seed=2**64)
    _assert_typed_error(UsageError, "seed", models=["tiny-llama"], seed=MAX_SEED)
