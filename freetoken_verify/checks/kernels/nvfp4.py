"""The NVFP4 part of the `kernels` check: the NVFP4 Triton kernels (routed-expert MoE, decode
and prefill paths, and the dense linear) and the engine's torch NVFP4 backend
(`freetoken.layers.quantization.nvfp4.reference`) against an oracle computed from the format
definition (`freetoken_verify.checks.kernels.nvfp4_oracle`: e2m1 codes, e4m3 block scales and fp32
global scales decoded from their bits, the MoE math in float64), over the matrix of
`freetoken_verify.checks.kernels.nvfp4_cases`. The backend's dequantized weights (w13 with gate and
up global scales, w2, the dense weight) must equal the oracle's bit for bit and its outputs match
within the kernels' tolerance; when they do not, the row blames the backend and says whether the
kernels agree with the oracle, instead of counting kernel failures.

Weights come from the NVFP4 quantizer applied to heavy-tailed random weights (Student-t, a
spread of per-expert scales), so block and global scales are realistic; every expert's up
projection is 1.8-3x larger than its gate, so their global scales differ (a gate/up mix-up
cannot cancel out). Full-size experts are quantized as a checkpoint would hold them, then cut
to rank 0's shard with the NVFP4 shard specs: the kernels see TP-local intermediate sizes
I / tp for tp in 1, 2, 4, 8.

Metrics (kernel vs oracle): max_abs and rel_l2 (worst case), pct_within_tol (all elements),
cases, failed_cases; backend_failed_cases (the torch backend vs the oracle).
"""

from __future__ import annotations

import math
import time

import torch

from freetoken.kernels import nvfp4_linear, nvfp4_moe
from freetoken.layers.moe import route
from freetoken.layers.quantization.nvfp4 import reference
from freetoken_verify.checks.kernels import nvfp4_oracle as oracle
from freetoken_verify.checks.kernels.judge import compare_output
from freetoken_verify.checks.kernels.nvfp4_cases import KernelCase, weights_for

BACKEND = "torch NVFP4 backend disagrees with the format oracle"


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    logits = torch.randn(tokens, experts, generator=gen) * 2.0
    return route(logits, top_k, renormalize=True, dtype=torch.float32)


def run_case(case: KernelCase, device, dtype: torch.dtype, seed: int,
             cache: dict | None = None) -> dict:
    """Kernel, and the engine's torch backend, against the format oracle for one case: a row
    of metrics (kernel vs oracle), with `failure` (the kernels' failure, str or None) and
    `backend_failure` (the torch backend's, str or None)."""

    cache = {} if cache is None else cache
    w = weights_for(case, device, cache)
    truth = _oracle_weights(case, w, cache)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(device, dtype)
    if case.kind == "linear":
        want = oracle.linear(x, truth["weight"])
        backend = reference.reference_linear(x, **w)
        out = nvfp4_linear.nvfp4_linear(x, **w)
    elif case.kind == "moe+shared":
        want, backend, out = _moe_with_shared(case, x, w, truth, gen)
    else:
        weights, ids = _routing(case.tokens, case.experts, case.top_k, gen)
        weights, ids = weights.to(device, dtype), ids.to(device)
        want = oracle.moe(x, weights, ids, truth["w13"], truth["w2"])
        backend = reference.reference_moe(x, weights, ids, **w)
        out = nvfp4_moe.fused_moe(x, weights, ids, **w)
    row = compare_output(case.label, out, want, dtype)
    row["backend_failure"] = truth["backend_failure"] or _backend_output(case, backend, want,
                                                                         dtype)
    return row


def _moe_with_shared(case: KernelCase, x: torch.Tensor, w: dict, truth: dict,
                     gen: torch.Generator) -> tuple:
    """(oracle, torch backend, kernel) outputs of the MoE block with its shared expert (the
    last of `w`'s experts) as one more slot of every token, weighted by sigmoid(gate . x)
    (the logit and the sigmoid rounded to x's dtype, as the block's combine rounds them),
    plus the residual: the oracle and the backend take the shared expert as expert E."""
    from freetoken.kernels.nvfp4_mma_launch import SharedSlot

    e, device, dtype = case.experts, x.device, x.dtype
    weights, ids = _routing(case.tokens, e, case.top_k, gen)
    gate_weight = (torch.randn(case.hidden, generator=gen) * 2 / case.hidden**0.5).to(device,
                                                                                     dtype)
    residual = torch.randn(case.tokens, case.hidden, generator=gen).to(device, dtype)
    gate = torch.sigmoid((x.float() @ gate_weight.float()).to(dtype).float()).to(dtype)
    all_weights = torch.cat([weights.to(device, dtype), gate[:, None]], 1)
    all_ids = torch.cat([ids, torch.full_like(ids[:, :1], e)], 1).to(device)
    want = oracle.moe(x, all_weights, all_ids, truth["w13"], truth["w2"]) + residual.double()
    backend = reference.reference_moe(x, all_weights, all_ids, **w) + residual
    routed = {k: v[:e] for k, v in w.items()}
    slot = SharedSlot(w["w13"][e], w["w13_scale"][e], w["w13_global"][e], 0, 1, w["w2"][e],
                      w["w2_scale"][e], w["w2_global"][e:], gate_weight, False)
    out = nvfp4_moe.fused_moe(x, weights.to(device, dtype), ids.to(device), **routed,
                              shared=slot, residual=residual)
    return want, backend, out


def _oracle_weights(case: KernelCase, w: dict, cache: dict) -> dict:
    """The format oracle's float32 weights for the case's weight set, and whether the torch
    backend dequantizes every one of them to the same bits (computed once per weight set)."""
    key = ("oracle", case.kind, case.experts, case.hidden, case.intermediate, case.tp)
    if key not in cache:
        cache[key] = (_oracle_linear(w) if case.kind == "linear" else _oracle_experts(w))
    return cache[key]


def _oracle_linear(w: dict) -> dict:
    truth = oracle.dequantize(w["packed"], w["block_scale"], w["global_scale"])
    got = reference.dequantize(w["packed"], w["block_scale"], w["global_scale"])
    return {"weight": truth, "backend_failure": _dequant_diff("weight", got, truth)}


def _oracle_experts(w: dict) -> dict:
    out = {"w13": {}, "w2": {}, "backend_failure": None}
    for e in range(w["w13"].shape[0]):
        out["w13"][e] = oracle.w13(w["w13"][e], w["w13_scale"][e], w["w13_global"][e])
        out["w2"][e] = oracle.dequantize(w["w2"][e], w["w2_scale"][e], w["w2_global"][e])
        out["backend_failure"] = out["backend_failure"] or _dequant_diff(
            f"w13 dequantization (expert {e})",
            reference.dequantize_w13(w["w13"][e], w["w13_scale"][e], w["w13_global"][e]),
            out["w13"][e]) or _dequant_diff(
            f"w2 dequantization (expert {e})",
            reference.dequantize(w["w2"][e], w["w2_scale"][e], w["w2_global"][e]),
            out["w2"][e])
    return out


def _dequant_diff(what: str, got: torch.Tensor, truth: torch.Tensor) -> str | None:
    """None when the backend's float32 weight equals the oracle's bit for bit, else where
    it first differs."""
    if got.shape != truth.shape or got.dtype != truth.dtype:
        return (f"{BACKEND} on {what}: shape {tuple(got.shape)} {got.dtype}, oracle "
                f"{tuple(truth.shape)} {truth.dtype}")
    differ = got.view(torch.int32) != truth.view(torch.int32)
    if not bool(differ.any()):
        return None
    first = tuple(differ.nonzero()[0].tolist())
    return (f"{BACKEND} on {what}: {int(differ.sum())} / {differ.numel()} values differ, "
            f"first at {list(first)}: backend {got[first].item():g}, oracle "
            f"{truth[first].item():g}")


def _backend_output(case: KernelCase, backend: torch.Tensor, want: torch.Tensor,
                    dtype) -> str | None:
    failure = compare_output(case.label, backend, want, dtype, "torch backend output")["failure"]
    return f"{BACKEND} on the output: {failure}" if failure else None


def run_matrix(cases: list[KernelCase], device, dtype: torch.dtype) -> list[dict]:
    """Every case, a kernel exception counting as that case's failure."""
    rows, cache = [], {}
    for i, case in enumerate(cases):
        start = time.monotonic()
        try:
            row = run_case(case, device, dtype, seed=1000 + i, cache=cache)
        except Exception as e:  # one broken case must not hide the others
            row = {"case": case.label, "max_abs": math.inf, "rel_l2": math.inf, "within": 0,
                   "numel": 1, "failure": f"{case.label}: {type(e).__name__}: {e}",
                   "backend_failure": None}
        row["seconds"] = time.monotonic() - start
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> tuple[dict, list[str]]:
    """Metrics over all cases (kernel vs the format oracle; `backend_failed_cases`: cases
    where the torch backend disagrees with the oracle) and the kernels' failures, in case
    order."""
    failures = [r["failure"] for r in rows if r["failure"]]
    numel = sum(r["numel"] for r in rows)
    metrics = {"max_abs": max((r["max_abs"] for r in rows), default=0.0),
               "rel_l2": max((r["rel_l2"] for r in rows), default=0.0),
               "pct_within_tol": 100.0 * sum(r["within"] for r in rows) / max(numel, 1),
               "cases": len(rows), "failed_cases": len(failures),
               "backend_failed_cases": sum(1 for r in rows if r.get("backend_failure"))}
    return metrics, failures


def verdict(rows: list[dict], dtype: str) -> str:
    """The row message: the torch backend blamed first when it disagrees with the oracle
    (with whether the kernels agree with the oracle), then the kernels' failures; "" when
    everything agrees."""
    failures = [r["failure"] for r in rows if r["failure"]]
    backend = [r["backend_failure"] for r in rows if r.get("backend_failure")]
    parts = []
    if backend:
        parts.append(f"{backend[0]} ({len(backend)} / {len(rows)} cases)")
    if failures:
        parts.append(f"kernels in {dtype}: {len(failures)} / {len(rows)} cases fail against "
                     f"the format oracle; first: {failures[0]}")
    elif backend:
        parts.append(f"the kernels agree with the oracle in all {len(rows)} cases")
    return "; ".join(parts)
