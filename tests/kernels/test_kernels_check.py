"""`freetoken-verify --checks kernels` on CPU (Triton interpreter, float32, the reduced CPU
matrix): it passes, runs once per TP size (the next model is skipped, saying so), and fails on
each injected NVFP4 kernel bug, naming a case."""

from __future__ import annotations

import json

import pytest

from verify.cli import main


def _run(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, _ = capsys.readouterr()
    return exit_info.value.code, out


def test_kernels_check_passes_once_per_tp_size(capsys, tmp_path):
    """The matrix passes for the first model and is skipped for the second, with a reason."""
    report = tmp_path / "r.json"
    code, out = _run(capsys, "--checks", "kernels", "--tp", "1", "--model", "tiny-llama",
                     "--model", "tiny-qwen3", "--report-json", str(report))
    assert code == 0, out
    first, second = json.loads(report.read_text())["results"]
    assert first["status"] == "pass" and first["metrics"]["failed_cases"] == 0, first
    assert first["metrics"]["cases"] >= 20 and first["metrics"]["pct_within_tol"] == 100.0
    assert second["status"] == "skip"
    assert second["message"] == "kernel matrix already run at tp=1 (with tiny-llama)"
    assert out.strip().splitlines()[-1] == "1 passed, 0 failed, 1 skipped"


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
