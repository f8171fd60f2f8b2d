"""The `kernels` check's GPU gate (marker `gpu`; skipped without CUDA): the PTX word decode
equals the portable decode bit for bit, the full GPU matrix passes in bf16 against the format
oracle, and every NVFP4 kernel fault fails the matrix.

Each runs `bench/gpu_kernels_check.py` in a fresh process without TRITON_INTERPRET (a test
process that ran a CPU kernel test has the interpreter switched on for good, and a fault
monkeypatches for good) and asserts on the JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_compiled

from freetoken_verify.faults import FAULTS, NVFP4_MOE_KERNEL_FAULTS

pytestmark = pytest.mark.gpu

NVFP4_KERNEL_FAULTS = list(NVFP4_MOE_KERNEL_FAULTS)
assert set(NVFP4_KERNEL_FAULTS) <= set(FAULTS)


def _run_matrix(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    report = tmp_path / "matrix.json"
    proc = run_compiled(["bench/gpu_kernels_check.py", "--json", str(report), *args])
    output = (proc.stdout + proc.stderr)[-3000:]
    assert report.is_file(), f"no JSON written (exit {proc.returncode}):\n{output}"
    return proc.returncode, json.loads(report.read_text()), output


def test_ptx_word_decode_matches_portable_and_quick_matrix_passes(tmp_path):
    """The PTX word decode gives the portable decode's values bit for bit (signed zeros
    included), and every 8th case of the matrix passes in bf16."""
    code, result, output = _run_matrix(tmp_path, "--quick")
    assert result["ptx_mismatches"] == 0, f"PTX decode differs:\n{output}"
    assert result["failures"] == [] and code == 0, output
    assert result["metrics"]["cases"] > 0, result["metrics"]


def test_full_matrix_passes_in_bf16(tmp_path):
    """Every case of the GPU matrix (tokens x experts x top-k x hidden x TP-local
    intermediate sizes, plus dense linears) agrees with the oracle in bf16."""
    code, result, output = _run_matrix(tmp_path, "--dtype", "bfloat16")
    assert code == 0 and result["failures"] == [], output
    assert result["metrics"]["failed_cases"] == 0, result["metrics"]


@pytest.mark.parametrize("fault", NVFP4_KERNEL_FAULTS)
def test_each_nvfp4_kernel_fault_fails_the_matrix(tmp_path, fault):
    """With one NVFP4 kernel fault injected, the quick matrix fails (exit 1) and names the
    first failing case."""
    code, result, output = _run_matrix(tmp_path, "--quick", "--inject", fault)
    assert code == 1 and result["failures"], f"{fault} not caught:\n{output}"
    assert result["metrics"]["failed_cases"] > 0, result["metrics"]
