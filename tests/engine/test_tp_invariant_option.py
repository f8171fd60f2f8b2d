"""The tp_invariant option as users reach it: `freetoken generate --tp-invariant` prints the
same tokens at TP 1 and 2 and refuses a CUDA placement with one line; an engine asked for it
on a device without the invariant paths refuses to start (naming the option); only the option
switches layers to the canonical reductions."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import GOLDEN

from freetoken.layers.linear import LinearBase
from freetoken.models.registry import build_model, load_config

CASE = GOLDEN / "tiny-qwen3.5-moe"


def _run_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken.cli", "generate", "--model",
                           str(CASE), "--device", "cpu", "--prompt-ids", "5,17,29,3",
                           "--max-tokens", "6", *args],
                          capture_output=True, text=True, timeout=300)


def _ids_lines(result: subprocess.CompletedProcess, label: str) -> list[str]:
    assert result.returncode == 0, f"{label}: exit {result.returncode}: {result.stderr[-500:]}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("ids:")]
    assert lines, f"{label}: no ids line in {result.stdout!r}"
    return lines


def test_generate_tp_invariant_same_tokens_at_tp1_and_tp2():
    """`--tp-invariant` runs at TP 1 and TP 2 and prints the same greedy tokens."""
    tp1 = _ids_lines(_run_generate("--tp", "1", "--tp-invariant"), "tp=1")
    tp2 = _ids_lines(_run_generate("--tp", "2", "--tp-invariant"), "tp=2")
    assert tp1 == tp2, f"--tp-invariant: tp=1 {tp1} != tp=2 {tp2}"


@pytest.mark.parametrize("tp_invariant", [False, True])
def test_only_the_option_switches_layers(tp_invariant):
    """Every linear layer of a model built with tp_invariant carries the canonical reductions
    (8 chunks for the bundled case); without it none does (the default paths run)."""
    with torch.device("meta"):
        model = build_model(load_config(CASE), tp_invariant)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]
    assert linears, "no linear layers found"
    for name, module in linears:
        if tp_invariant:
            assert module.canonical is not None and module.canonical.chunks == 8, name
        else:
            assert module.canonical is None, name
