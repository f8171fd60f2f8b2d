"""The quantized-GEMM part of the `kernels` check: every weight-only GEMM the engine runs
(NVFP4 dense in both scale conventions, FP8 per tensor, FP8 block, routed experts in block
FP8 and NVFP4) against a float64 oracle computed from the format definitions
(`freetoken_verify.checks.kernels.quant_oracle`), over the cases of
`freetoken_verify.checks.kernels.quant_cases`.

The layer under test is whatever the engine dispatches to on the device: the check builds it
through the engine's own entry points, as that rank of that TP size would
(`freetoken.layers.quantization.linear_method` in a `LinearBase`, or the experts module the
models build), fills its parameters with the rank's cut of freshly quantized checkpoint
tensors (`freetoken_verify.checks.kernels.quant_data`) and calls it, inside a forward
context that carries device tensors on CUDA, as an engine step does (so the Triton paths are
taken where the engine takes them). A layer whose parameters do not have the documented
rank-local shapes and dtypes fails naming the parameter.

A row per case; a failing row names the format, layout, TP size and rank, the rank-local
shape and the worst element (`freetoken_verify.checks.kernels.judge`)."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch

from freetoken import context
from freetoken.distributed import TPInfo, acting_as
from freetoken.formats.quant.format import FP8_BLOCK
from freetoken.layers.linear import LinearBase
from freetoken.layers.moe import route
from freetoken.layers.quantization import linear_method
from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts
from freetoken_verify.checks.kernels.judge import compare_output
from freetoken_verify.checks.kernels.nvfp4_oracle import moe as oracle_moe
from freetoken_verify.checks.kernels.quant_cases import QuantCase
from freetoken_verify.checks.kernels.quant_data import experts_data, linear_data
from freetoken_verify.checks.quant_layout import Experts, rows_on

FAMILY = "quantized"
class LayoutMismatch(ValueError):
    """The layer's parameters are not the rank-local tensors its format documents."""


@contextmanager
def engine_step(device: torch.device, tokens: int):
    """A forward context as the model runner sets for a prefill of `tokens` tokens: with
    device tensors on CUDA (where the engine takes its Triton paths), none on CPU."""
    batch = None
    if device.type == "cuda":
        batch = context.device_batch([tokens], [tokens], [[0]], [0], device)
    step = context.ForwardContext(True, [tokens], [tokens], torch.arange(tokens), [[0]], [0],
                                  batch)
    try:
        previous = context.get_forward_context()
    except RuntimeError:
        previous = None
    context.set_forward_context(step)
    try:
        yield
    finally:
        context.set_forward_context(previous)


def _build(case: QuantCase):
    """The engine's layer for the case, built as rank `case.rank` of `case.tp` would."""
    if isinstance(case.layout, Experts):
        e = case.layout
        if case.fmt.kind == FP8_BLOCK:
            return BlockFP8FusedExperts(e.experts, e.hidden, e.intermediate, case.fmt.block,
                                        case.fmt.input_scales)
        return NVFP4FusedExperts(e.experts, e.hidden, e.intermediate,
                                 global_scale_is_reciprocal=case.fmt.global_scale_is_reciprocal)
    layout = case.layout
    method = linear_method(case.fmt, list(layout.rows), layout.cols)
    local_in = rows_on(layout.cols, case.rank, case.tp)[1]
    local_out = sum(rows_on(s, case.rank, case.tp)[1] for s in layout.rows)
    return LinearBase(local_in, local_out, quant=method)


def fill(layer: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy the rank's parameters into the layer; LayoutMismatch naming the parameter when
    the layer holds another shape or dtype (scales may be held in any float dtype that keeps
    their values), lacks one, or holds one the format does not define."""
    have = dict(layer.named_parameters())
    extra = sorted(set(have) - set(params))
    if extra:
        raise LayoutMismatch(f"the layer holds {', '.join(extra)}, which the format does not "
                             "define")
    for name, value in params.items():
        if name not in have:
            raise LayoutMismatch(f"the layer holds no {name}")
        param = have[name]
        if tuple(param.shape) != tuple(value.shape):
            raise LayoutMismatch(f"{name}: the layer holds {list(param.shape)} "
                                 f"{_dtype(param)}, the format's rank-local layout is "
                                 f"{list(value.shape)} {_dtype(value)}")
        if param.dtype != value.dtype and not (param.is_floating_point()
                                               and value.is_floating_point()
                                               and value.element_size() > 1):
            raise LayoutMismatch(f"{name}: the layer holds {_dtype(param)}, the format "
                                 f"stores {_dtype(value)}")
        param.data.copy_(value)
        if not torch.equal(param.data.to(value.dtype), value):
            raise LayoutMismatch(f"{name}: held in {_dtype(param)}, which does not keep the "
                                 f"stored {_dtype(value)} values")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def run_case(case: QuantCase, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    """One case: the engine's layer on the rank's parameters against the oracle; a row of
    metrics with `failure` (str or None)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with acting_as(TPInfo(case.rank, case.tp)):
        layer = _build(case).to(device)
        x = torch.randn(case.tokens, _hidden(case), generator=gen, device=device).to(dtype)
        if isinstance(case.layout, Experts):
            params, w13, w2 = experts_data(case.fmt, case.layout, case.rank, case.tp, gen)
            logits = torch.randn(case.tokens, case.layout.experts, generator=gen,
                                 device=device) * 2.0
            weights, ids = route(logits, case.layout.top_k, renormalize=True, dtype=dtype)
            fill(layer, params)
            want = oracle_moe(x, weights, ids, w13, w2)
            with engine_step(device, case.tokens):
                out = layer(x, weights, ids)
        else:
            params, weight = linear_data(case.fmt, case.layout, case.rank, case.tp, gen)
            fill(layer, params)
            want = x.to(torch.float64) @ weight.T
            with engine_step(device, case.tokens):
                out = layer(x)
    return compare_output(case.label, out, want, dtype)


def _hidden(case: QuantCase) -> int:
    if isinstance(case.layout, Experts):
        return case.layout.hidden
    return rows_on(case.layout.cols, case.rank, case.tp)[1]


def run_matrix(cases: list[QuantCase], device, dtype: torch.dtype) -> list[dict]:
    """Every case; an exception (a layer that refuses the shape, a layout mismatch) counts
    as that case's failure."""
    rows = []
    for i, case in enumerate(cases):
        start = time.monotonic()
        try:
            row = run_case(case, torch.device(device), dtype, seed=3000 + i)
        except Exception as e:  # one broken case must not hide the others
            row = {"case": case.label, "max_abs": math.inf, "rel_l2": math.inf, "within": 0,
                   "numel": 1, "failure": f"{case.label}: {type(e).__name__}: {e}"}
        row.update(family=FAMILY, format=case.fmt.describe(), model=case.model,
                   seconds=time.monotonic() - start)
        rows.append(row)
    return rows


def family_metrics(rows: list[dict]) -> dict:
    """The quantized family's metrics (with the seconds its cases took), and per format."""
    def summary(mine):
        numel = sum(r["numel"] for r in mine)
        return {"max_abs": max(r["max_abs"] for r in mine),
                "rel_l2": max(r["rel_l2"] for r in mine),
                "pct_within_tol": 100.0 * sum(r["within"] for r in mine) / max(numel, 1),
                "cases": len(mine), "failed_cases": sum(1 for r in mine if r["failure"])}

    if not rows:
        return {}
    out = summary(rows)
    out["seconds"] = round(sum(r["seconds"] for r in rows), 3)
    out["formats"] = {f: summary([r for r in rows if r["format"] == f])
                      for f in dict.fromkeys(r["format"] for r in rows)}
    return {FAMILY: out}


def verdict(rows: list[dict], dtype: str) -> str:
    """"" when every case passes; else how many fail, in which formats, and the first."""
    failures = [r for r in rows if r["failure"]]
    if not failures:
        return ""
    counts: dict[str, int] = {}
    for r in failures:
        counts[r["format"]] = counts.get(r["format"], 0) + 1
    formats = ", ".join(f"{k} x{n}" for k, n in counts.items())
    return (f"quantized GEMMs in {dtype}: {len(failures)} / {len(rows)} cases fail against "
            f"the format oracle ({formats}); first: {failures[0]['failure']}")

