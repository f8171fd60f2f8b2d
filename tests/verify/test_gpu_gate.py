"""The GPU gate script (`bench/gpu_gate.sh`), dry-run on CPU ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from freetoken_verify.cases.catalogue import CASES

ROOT = Path(__file__).resolve().parents[2]


def test_gate_runs_every_bundled_case_in_fp32_and_bf16(tmp_path):
    """The bundled part of the gate exits 0 and writes one report per run: fp32 on every case,
    bf16 against live HF on the unquantized cases, and the quantized cases, whatever file
    holds their quantization config, in bf16 against their stored golden."""
    env = {**os.environ, "DEVICE": "cpu", "TP": "1", "PART": "bundled",
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_gate.sh"), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    models = {}
    for name in ("bundled-fp32", "bundled-bf16", "bundled-quantized-bf16"):
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["summary"]["failed"] == 0 and report["summary"]["passed"] > 0, name
        models[name] = {r["model"] for r in report["results"]}
    quantized = {n for n, spec in CASES.items() if spec.quantized}
    assert {"tiny-qwen3.5-moe-nvfp4", "tiny-qwen3.5-moe-nvfp4-ct", "tiny-qwen3-fp8"} <= quantized
    assert quantized <= models["bundled-fp32"]
    assert not quantized & models["bundled-bf16"], models["bundled-bf16"]
    assert models["bundled-quantized-bf16"] == quantized
    assert models["bundled-bf16"] | models["bundled-quantized-bf16"] == models["bundled-fp32"]
