"""The weight-only quantized GEMMs (`freetoken.kernels.quant_gemm`) compiled on a GPU (marker
`gpu`; skipped without CUDA): block FP8, FP8 per tensor and NVFP4 in both producers'
conventions, at the TP-local shapes of Qwen3.5-35B-A3B's projections for TP 1, 2, 4 and 8
(the last rank of each: offsets inside shared blocks), 1, 5, 16 and 64 tokens (decode and
prefill tiles), bf16 activations, through the linear methods' kernels: each within 1e-2
relative L2 of float32 on the torch path's dequantized weights, and a CUDA graph's replay
equal to the eager call bit for bit.

It runs `bench/quant_linear.py --check` in a fresh process without TRITON_INTERPRET (a test
process that ran a CPU kernel test has the interpreter switched on for good) and asserts
on the JSON it writes."""

from __future__ import annotations

import json

import pytest
from conftest import run_compiled

pytestmark = pytest.mark.gpu
FORMATS = {"fp8-block", "fp8-tensor", "nvfp4", "nvfp4-ct"}


def test_every_format_matches_the_torch_path_in_bf16_at_tp_1_2_4_8(tmp_path):
    """Every row of the check passes, and every format appears at every TP size."""
    report = tmp_path / "check.json"
    proc = run_compiled(["bench/quant_linear.py", "--check", "--json", str(report)])
    output = (proc.stdout + proc.stderr)[-3000:]
    assert report.is_file(), f"no JSON written (exit {proc.returncode}):\n{output}"
    result = json.loads(report.read_text())
    assert proc.returncode == 0 and result["failures"] == [], output
    seen = {(r["format"], r["tp"]) for r in result["rows"]}
    assert seen == {(f, tp) for f in FORMATS for tp in (1, 2, 4, 8)}, sorted(seen)
