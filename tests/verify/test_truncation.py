"""`--num-layers` truncates the engine and the live HF reference alike for any layer order:
tiny-qwen3.5-moe's layer 0 is linear attention, and HF's hybrid cache cannot measure a
sequence without an attention layer, so the truncated reference runs without a cache."""

from __future__ import annotations

import json

import pytest

from freetoken_verify.cli import main


def test_hybrid_model_truncated_to_a_linear_attention_layer_passes_golden(capsys, tmp_path):
    """tiny-qwen3.5-moe with --num-layers 1 --reference hf: golden passes at TP 2."""
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "tiny-qwen3.5-moe", "--num-layers", "1", "--reference", "hf",
              "--tp", "2", "--checks", "golden", "--report-json", str(report)])
    out, _ = capsys.readouterr()
    assert exit_info.value.code == 0, out
    result = json.loads(report.read_text())["results"][0]
    assert result["status"] == "pass" and result["metrics"]["greedy_match"] > 0, result
