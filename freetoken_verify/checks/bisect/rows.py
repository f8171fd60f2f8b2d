"""bisect's rows from captures: each captured module compared with TP=1's same capture and
with HF's tensors, under the run's bounds (float32: 1e-3 relative L2; bf16 / fp16: 3x HF's own
error at that module, at least 2e-2, else the bound golden puts on the logits)."""

from __future__ import annotations

import torch

from freetoken.engine.core import resolve_dtype
from freetoken_verify.checks.base import CheckContext
from freetoken_verify.checks.bisect.capture import Activation
from freetoken_verify.checks.bisect.table import Row, compare_with_tp1, row_distance
from freetoken_verify.compare import (
    BISECT_FP32_BOUND,
    BISECT_LOW_FACTOR,
    BISECT_LOW_FLOOR,
    logits,
)
from freetoken_verify.reference.sources import reference_for, reference_source


def references(ctx: CheckContext, tp1: bool, hf: bool) -> tuple[str, ...]:
    """The names of the references a localisation compared with."""
    tp1_name = "TP=1 (bitwise)" if ctx.options.bitwise else "TP=1"
    return tuple(n for n, ok in ((tp1_name, tp1), ("HF", hf)) if ok)


def build_rows(full, tp1, hf_for, ctx) -> list[Row]:
    """One row per captured module that has a reference (or diverged on its own): compared
    with `tp1`'s same key (bit for bit when the run is bitwise, except the partial sums the
    parent added up) and with HF's tensors
    `hf_for(key, tensor)` -> (float32, low precision), each None where HF has none."""
    low = resolve_dtype(ctx.options.dtype, ctx.case.model_config) != torch.float32
    fallback = _logit_bound(ctx) if low else BISECT_FP32_BOUND
    bitwise = bool(ctx.options.bitwise)
    rows = []
    for key, entry in full.items():
        tensor, disagree, summed = Activation(*entry)
        row = Row(key, ranks_disagree=disagree)
        if tp1 is not None and key in tp1:
            # A sum over ranks is the parent's arithmetic: compared within the bounds.
            compare_with_tp1(row, tensor, tp1[key][0], bitwise and not summed)
        exact, rounded = hf_for(key, tensor)
        hf_t = _rows_like(exact, tensor)
        if hf_t is not None and hf_t.shape == tensor.shape:
            row.vs_hf = row_distance(tensor, hf_t)
        if low:
            row.bound = _low_bound(exact, rounded, fallback)
        if row.vs_tp1 is not None or row.vs_hf is not None or row.diverged:
            rows.append(row)
    return rows


def _rows_like(hf_t: torch.Tensor | None, tensor: torch.Tensor) -> torch.Tensor | None:
    """The engine runs the LM head on a prefill's last token only: HF's last row then."""
    if hf_t is not None and tensor.shape[0] == 1 and hf_t.shape[0] > 1:
        return hf_t[-1:]
    return hf_t


def _logit_bound(ctx: CheckContext) -> float:
    """Without HF at the engine's dtype, a module may differ from TP=1 by as much as golden
    lets the logits differ (for a bundled case: its stored low-precision baseline)."""

    dtype = resolve_dtype(ctx.options.dtype, ctx.case.model_config)
    baseline = None
    if reference_source(ctx.case, ctx.options) == "golden":
        # The run's stored reference, loaded once and shared with golden.
        stored = reference_for(ctx).baseline
        baseline = stored[0] if stored else None
    return logits.effective_tolerance(dtype, baseline).max_rel_l2


def _low_bound(exact: torch.Tensor | None, low: torch.Tensor | None, fallback: float) -> float:
    if exact is None or low is None or exact.shape != low.shape:
        return fallback
    return max(BISECT_LOW_FLOOR, BISECT_LOW_FACTOR * row_distance(low, exact))
