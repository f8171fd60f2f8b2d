"""The block-FP8 routed experts' CUDA path (`freetoken.kernels.fused_moe` with block scales,
taken by `BlockFP8FusedExperts` in a step that runs the Triton kernels) in Triton's
interpreter with float32 activations, against the `kernels` check's float64 oracle computed
from the format definition, for every rank of TP 1, 2, 4 and 8, at one token (the row
kernels, `freetoken.kernels.moe_rows`) and at seven (the grouped kernels):

- 24 x 40 blocks over experts of I = 128 (every dim ends in a partial block; at TP 4 and 8
  ranks share blocks and start inside them): the scale applied to every weight element;
- 128 x 128 blocks over I = 512 (Qwen3.5-35B-A3B's, 64 a rank at TP 8, half a block): the
  scale applied once per K step, the odd ranks half a block into their column block;
- injected bugs the comparison must catch (at one token): the column offset inside a shared
  block dropped, the up rows reading the gate's scale rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interpreted import TP_SIZES, interpreter  # noqa: F401  (module-wide fixture)

from freetoken.formats.quant.format import FP8_BLOCK, HF_FP8, ModuleFormat
from freetoken.kernels import fused_moe
from freetoken.layers.quantization.fp8 import moe as fp8_moe
from freetoken_verify.checks.kernels import quant
from freetoken_verify.checks.kernels.quant_cases import QuantCase
from freetoken_verify.checks.quant_layout import Experts

PARTIAL = (Experts(experts=6, top_k=2, hidden=112, intermediate=128), (24, 40))
WHOLE = (Experts(experts=4, top_k=2, hidden=256, intermediate=512), (128, 128))


@pytest.fixture()
def kernel_path(monkeypatch):
    """The experts take their CUDA path on CPU tensors (interpreted kernels)."""
    monkeypatch.setattr(fp8_moe, "uses_kernels", lambda: True)
    monkeypatch.setattr(fp8_moe.quant_gemm, "serves", lambda x: True)


def _rows(experts: Experts, block, tokens: int, last_only: bool = False) -> list[dict]:
    """The check's row of every rank (or of the last rank) of each TP size."""
    fmt = ModuleFormat(FP8_BLOCK, HF_FP8, block)
    rows = []
    for tp in TP_SIZES:
        for rank in [tp - 1] if last_only else range(tp):
            case = QuantCase(fmt, experts, tp, rank, tokens, "test")
            rows.append(quant.run_case(case, torch.device("cpu"), torch.float32,
                                       seed=tp * 10 + rank))
    return rows


@pytest.mark.parametrize("layout", [PARTIAL, WHOLE], ids=["24x40", "128x128"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_block_fp8_experts_kernel_follows_the_definition(kernel_path, layout, tokens):
    failures = [r["failure"] for r in _rows(*layout, tokens) if r["failure"]]
    assert not failures, failures[0]


def test_the_scale_placements_are_both_taken(kernel_path, monkeypatch):
    """The 24 x 40 layout scales every element (SCALE 2), the 128 x 128 one every K step
    (SCALE 1), in both kernels: the parametrisation above covers both placements."""
    seen = []
    original = fused_moe._scale_args

    def record(scales, block_k, weight):
        args, step = original(scales, block_k, weight)
        seen.append((scales.block_cols, args["SCALE"]))
        return args, step

    monkeypatch.setattr(fused_moe, "_scale_args", record)
    _rows(*PARTIAL, 1, last_only=True)
    _rows(*WHOLE, 1, last_only=True)
    assert set(seen) == {(40, 2), (128, 1)}


def test_dropped_column_offset_is_caught(kernel_path, monkeypatch):
    """Ranks that start inside a shared column block of w2 but index its scale from the
    block's start (offset dropped) fail where their slice crosses into the next block: the
    last rank of TP 2, 4 and 8 over 40-wide blocks (it starts 24, 16 and 32 inputs in);
    at TP 1 the offset is 0."""
    original = fused_moe.fused_moe

    def no_offset(*args, w2_scales=None, **kw):
        return original(*args, w2_scales=dataclasses.replace(w2_scales, col_offset=0), **kw)

    monkeypatch.setattr(fp8_moe.fused_moe, "fused_moe", no_offset)
    rows = _rows(*PARTIAL, 1, last_only=True)
    assert [bool(r["failure"]) for r in rows] == [False, True, True, True], \
        [r["case"] for r in rows]


def test_up_rows_reading_gate_scales_are_caught(kernel_path, monkeypatch):
    """One scale-row index for gate and up (the up segment's own scale rows ignored) fails
    at every TP size: gate and up are quantized with unequal scales."""
    original = fused_moe.fused_moe

    def gate_rows_for_up(*args, w13_scales=None, **kw):
        rows = w13_scales.rows.clone()
        half = rows.numel() // 2
        rows[half:] = rows[:half]
        return original(*args, w13_scales=dataclasses.replace(w13_scales, rows=rows), **kw)

    monkeypatch.setattr(fp8_moe.fused_moe, "fused_moe", gate_rows_for_up)
    rows = _rows(*PARTIAL, 1, last_only=True)
    assert all(r["failure"] for r in rows), [r["case"] for r in rows if not r["failure"]]
