"""`freetoken-verify --checks kernels` on CPU (Triton interpreter, float32, the reduced CPU
matrix): it passes, runs once per TP size (the next model is skipped, saying so), and fails on
each injected NVFP4 kernel bug, naming a case and blaming the kernels; a bug injected into the
engine's torch NVFP4 backend instead is blamed on the backend, naming the quantity it gets
wrong, while the kernels are reported to agree with the format oracle (the quantized GEMMs'
part is `tests/kernels/test_quant_kernels_check.py`)."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken_verify.checks.kernels import check as kernels
from freetoken_verify.cli import main
from freetoken_verify.faults import FAULTS


def _run(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, _ = capsys.readouterr()
    return exit_info.value.code, out


def test_kernels_check_runs_once_per_run(capsys, tmp_path):
    """The matrix (every TP size's shapes) passes on the first row and is skipped, with the
    reason, for the other model and the other TP size; a run that does not name the check
    leaves it out on CPU ranks and says why."""
    report = tmp_path / "r.json"
    code, out = _run(capsys, "--checks", "kernels", "--tp", "1,2", "--model", "tiny-llama",
                     "--model", "tiny-qwen3", "--report-json", str(report))
    assert code == 0, out
    first, *others = json.loads(report.read_text())["results"]
    assert first["status"] == "pass" and first["metrics"]["failed_cases"] == 0, first
    assert first["metrics"]["cases"] >= 20 and first["metrics"]["pct_within_tol"] == 100.0
    assert [r["status"] for r in others] == ["skip"] * 3, others
    assert others[-1]["message"] == ("kernel matrix (every TP size's shapes) already run in "
                                     "this run, at tp=1 with tiny-llama"), others[-1]
    assert out.strip().splitlines()[-1] == "1 passed, 0 failed, 3 skipped"
    code, out = _run(capsys, "--tp", "1", "--model", "tiny-llama", "--dry-run")
    assert code == 0 and "tiny-llama kernels" not in out, out
    assert "note: kernels: left out (CPU ranks run no Triton kernel" in out, out


@pytest.mark.parametrize("fault", ["nvfp4-nibble-swap", "nvfp4-drop-global-scale",
                                   "nvfp4-gate-up-globals-swapped",
                                   "nvfp4-intermediate-off-by-group"])
def test_kernels_check_fails_on_injected_fault(capsys, tmp_path, fault):
    """Each fault fails the check, and the message names a failing case and its mismatch."""
    report = tmp_path / "r.json"
    code, out = _run(capsys, "--checks", "kernels", "--tp", "1", "--model", "tiny-llama",
                     "--inject", fault, "--report-json", str(report))
    assert code == 1, out
    (result,) = json.loads(report.read_text())["results"]
    assert result["status"] == "fail", result
    assert result["metrics"]["failed_cases"] >= 1
    message = result["message"]
    assert message.startswith("tiny-llama tp=1: kernels in float32:"), message
    assert "moe experts=" in message and "mismatched" in message, message
    assert "torch NVFP4 backend" not in message and \
        result["metrics"]["backend_failed_cases"] == 0, message


def test_kernels_check_blames_the_torch_backend(capsys, tmp_path):
    """The torch backend reading nibbles in the wrong order fails the row, which says the
    backend disagrees with the format oracle on w13 dequantization and that the kernels agree
    with the oracle; the quantized GEMMs' NVFP4 cases, which run on that backend on CPU, fail
    too, and only they."""
    report = tmp_path / "r.json"
    code, out = _run(capsys, "--checks", "kernels", "--tp", "1", "--model", "tiny-llama",
                     "--inject", "torch-nvfp4-nibble-swap", "--report-json", str(report))
    assert code == 1, out
    (result,) = json.loads(report.read_text())["results"]
    families = result["metrics"]["families"]
    assert result["status"] == "fail" and families["nvfp4"]["failed_cases"] == 0, result
    nvfp4_cases = families["nvfp4"]["cases"]
    assert result["metrics"]["backend_failed_cases"] == nvfp4_cases, result
    failed = {f for f, m in families["quantized"]["formats"].items() if m["failed_cases"]}
    assert failed == {"NVFP4 (modelopt)", "NVFP4 (compressed-tensors)"}, families["quantized"]
    message = result["message"]
    assert message.startswith("tiny-llama tp=1: torch NVFP4 backend disagrees with the format "
                              "oracle on w13 dequantization (expert 0): "), message
    assert f"; the kernels agree with the oracle in all {nvfp4_cases} cases; quantized GEMMs " \
           "in float32: " in message, message


SMALL = [kernels.KernelCase("moe", 7, 8, 2, 48, 64, 2),
         kernels.KernelCase("linear", 3, 1, 1, 64, 32, 1)]


@pytest.fixture()
def restore_nvfp4(monkeypatch):
    """Faults replace module attributes; re-setting them through monkeypatch first makes
    pytest restore the originals after the test."""
    from interpreted import require_interpreter

    require_interpreter()
    from freetoken.formats.nvfp4 import format as nvfp4_format
    from freetoken.kernels import nvfp4_linear, nvfp4_moe
    from freetoken.layers.quantization.nvfp4 import reference

    for module, name in ((nvfp4_format, "unpack_nibbles"), (reference, "dequantize_w13"),
                         (nvfp4_moe, "fused_moe"), (nvfp4_linear, "nvfp4_linear")):
        monkeypatch.setattr(module, name, getattr(module, name))


@pytest.mark.parametrize("fault, words", [
    ("torch-nvfp4-nibble-swap", "on w13 dequantization (expert 0): "),
    ("torch-nvfp4-drop-w13-global", "on w13 dequantization (expert 0): "),
])
def test_backend_fault_is_blamed_on_the_backend(restore_nvfp4, fault, words):
    """On a small matrix (one MoE, one linear case), a backend fault sets each MoE case's
    backend failure, leaves the kernels' failures empty, and the verdict blames the
    backend."""
    FAULTS[fault]()
    rows = kernels.run_matrix(SMALL, "cpu", torch.float32)
    assert rows[0]["backend_failure"] and rows[0]["failure"] is None, rows[0]
    assert all(r["failure"] is None for r in rows), rows
    verdict = kernels.verdict(rows, "float32")
    assert verdict.startswith("torch NVFP4 backend disagrees with the format oracle " + words)
    assert verdict.endswith("the kernels agree with the oracle in all 2 cases"), verdict


def test_kernel_fault_is_blamed_on_the_kernels(restore_nvfp4):
    """A kernel fault on the same matrix leaves the backend agreeing with the oracle and the
    verdict blames the kernels."""
    FAULTS["nvfp4-drop-global-scale"]()
    rows = kernels.run_matrix(SMALL, "cpu", torch.float32)
    assert rows[0]["failure"] and not any(r["backend_failure"] for r in rows), rows
    assert kernels.verdict(rows, "float32").startswith(
        "kernels in float32: 1 / 2 cases fail against the format oracle; first: moe "), rows


def test_clean_small_matrix_agrees_with_the_oracle(restore_nvfp4):
    """Without faults the kernels and the backend agree with the oracle: no verdict."""
    rows = kernels.run_matrix(SMALL, "cpu", torch.float32)
    assert kernels.verdict(rows, "float32") == "", rows
