"""The harness's bitwise mode (`--bitwise`, the default on CPU ranks): golden runs the engine's
tp_invariant mode and requires TP=N to equal TP=1 bit for bit, so a fault far below every
tolerance (bf16 partial sums on the wire) fails a row that says how many elements differ and
by how many ulps; where the mode cannot run, asking for it is a usage error and the default
falls back to the tolerance comparison."""

from __future__ import annotations

import json

import torch
from cli_run import assert_refused, run_cli

import freetoken_verify.running.plan as plan_module
from freetoken_verify.compare import bitwise_difference, ulp_order


def _golden_rows(capsys, tmp_path, *extra: str) -> tuple[int, list[dict]]:
    report = tmp_path / "report.json"
    code, out, err = run_cli(capsys, "--model", "tiny-qwen3-moe", "--tp", "1,2", "--checks",
                             "golden", "--dtype", "bfloat16", "--report-json", str(report),
                             *extra)
    return code, json.loads(report.read_text())["results"]


def test_bitwise_golden_passes_and_says_so(capsys, tmp_path):
    """On CPU, golden is bitwise by default: both rows pass in bf16 and TP=2's row compared
    its tensors with TP=1's and found none differing."""
    code, rows = _golden_rows(capsys, tmp_path)
    assert code == 0, rows
    tp2 = next(r for r in rows if r["tp"] == 2)
    assert tp2["metrics"]["bitwise"] == 1 and tp2["metrics"]["tp1_differing"] == 0, tp2
    assert tp2["metrics"]["tp1_tensors"] > 0, tp2


def test_a_fault_below_every_tolerance_fails_bitwise(capsys, tmp_path):
    """The invariant all-reduce summing bf16 partials (logits off by ~1e-2 relative, inside
    the bf16 bound) fails TP=2's golden row, naming the prompt, the count and the ulps."""
    code, rows = _golden_rows(capsys, tmp_path, "--inject", "invariant-bf16-wire")
    assert code == 1, rows
    tp2 = next(r for r in rows if r["tp"] == 2)
    assert tp2["status"] == "fail" and "vs tp=1" in tp2["message"], tp2
    assert "differ bit for bit" in tp2["message"] and "ulp" in tp2["message"], tp2
    assert next(r for r in rows if r["tp"] == 1)["status"] == "pass", rows


def test_bitwise_where_the_mode_cannot_run(capsys, monkeypatch, tmp_path):
    """A TP size the canonical chunk count does not divide: `--bitwise` is refused before any
    rank starts, naming the model and TP size; by default the run falls back to tolerances."""
    monkeypatch.setattr(plan_module, "canonical_chunks", lambda cfg: 1)
    assert_refused(capsys, ["--model", "tiny-llama", "--tp", "1,2", "--checks", "golden",
                            "--bitwise"], "--bitwise", "tiny-llama: tp=2 does not divide")
    code, rows = _golden_rows(capsys, tmp_path)
    assert code == 0 and all("bitwise" not in r["metrics"] for r in rows), rows


def test_bitwise_difference_counts_elements_and_ulps():
    """Equal bits give None; one element one ulp apart in bf16 is reported as 1 / n elements,
    1 ulp, at its index; +0 and -0 differ in bits but are 0 ulp apart."""
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    b = a.clone()
    assert bitwise_difference(a, b, "x") is None
    b[1, 0] = a[1, 0].view(torch.int16).add(1).view(torch.bfloat16)
    message = bitwise_difference(b, a, "x")
    assert "1 / 4 elements" in message and "largest 1 ulp at (1, 0)" in message, message
    zeros = torch.tensor([0.0, -0.0])
    assert int((ulp_order(zeros)[0] - ulp_order(zeros)[1]).abs()) == 0
    assert bitwise_difference(torch.tensor([1, 2]), torch.tensor([1, 3]), "ids") is not None
