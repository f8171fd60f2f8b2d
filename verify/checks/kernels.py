"""kernels: the NVFP4 Triton kernels (routed-expert MoE, decode and prefill paths, and the dense
linear) and the engine's torch NVFP4 backend (`freetoken.layers.quantization.nvfp4.reference`)
against an oracle the check computes itself from the format definition (`verify.nvfp4_oracle`:
e2m1 codes, e4m3 block scales and fp32 global scales decoded from their bits, the MoE math in
float64), over a matrix of shapes. The backend's dequantized weights (w13 with gate and up
global scales, w2, the dense weight) must equal the oracle's bit for bit and its outputs match
within the kernels' tolerance; when they do not, the row blames the backend and says whether
the kernels agree with the oracle, instead of counting kernel failures. It verifies kernels,
not the case's model: it runs for the first model of each TP size, on rank 0 only (other
ranks idle), and reports `skip` for the other models.

Weights come from the NVFP4 quantizer applied to heavy-tailed random weights (Student-t, a
spread of per-expert scales), so block and global scales are realistic; every expert's up
projection is 1.8-3x larger than its gate, so their global scales differ (a gate/up mix-up
cannot cancel out). Full-size experts are quantized as a checkpoint would hold them, then cut
to rank 0's shard with the NVFP4 shard specs: the kernels see TP-local intermediate sizes
I / tp for tp in 1, 2, 4, 8.

GPU: bf16 activations (or --dtype), H in {2048, 1040} (1040: groups that do not fill a tile),
I = 512, the full product tokens {1, 7, 64, 300} x experts {8, 64} x top-k {1, 2, 8} x H x tp.
CPU: the Triton interpreter, float32 activations (it computes bf16 arithmetic wrongly), and a
reduced matrix because it runs programs one by one in numpy: H in {64, 48}, I = 128, every
tokens x tp pair once, experts / top-k / H cycling, so each value of each axis and both the
decode (<= 16 tokens) and prefill paths are covered. The interpreter is switched on inside the
rank process (`freetoken.kernels.use_interpreter`, before the first kernel import, which fixes
the process's kernel mode): rank groups are started once per TP size for
every check, so the check cannot give its ranks a different environment.

Per case: NaN / Inf in the kernel output fail it; elements are compared with
|out - ref| <= atol * rms(ref) + rtol * |ref| (float32: 1e-4 / 1e-4, differences come from
summation order only; bf16: 2e-2 / 2e-2, the output and SiLU(gate) * up are rounded to bf16).
float32 requires every element within; bf16 / fp16 require the relative L2 error within
LOW_PRECISION_REL_L2 and at least 99.9 % of elements within: rounding SiLU(gate) * up to bf16
before the down projection moves a few elements where large terms cancel by a whole bf16 ulp
of the terms (measured on an H200: 1 element in 131072 off by 1.0, relative L2 3e-3), while
every injected kernel bug moves relative L2 by 0.3 or more.
Metrics (kernel vs oracle): max_abs and rel_l2 (worst case), pct_within_tol (all elements),
cases, failed_cases; backend_failed_cases (the torch backend vs the oracle).
"""

from __future__ import annotations

import math
import time

import torch

from verify import nvfp4_oracle as oracle
from verify.checks.base import CheckContext
from verify.compare import compare_tensors
from verify.kernel_cases import KernelCase, cpu_matrix, gpu_matrix, make_experts, weights_for
from verify.report import CheckResult

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2),
             torch.float16: (1e-2, 1e-2)}
LOW_PRECISION_REL_L2 = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
MIN_WITHIN = 0.999
BACKEND = "torch NVFP4 backend disagrees with the format oracle"
__all__ = ["KernelCase", "cpu_matrix", "gpu_matrix", "make_experts", "run", "run_case",
           "run_matrix", "summarize"]


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    from freetoken.layers.moe import route

    logits = torch.randn(tokens, experts, generator=gen) * 2.0
    return route(logits, top_k, renormalize=True, dtype=torch.float32)


def run_case(case: KernelCase, device, dtype: torch.dtype, seed: int,
             cache: dict | None = None) -> dict:
    """Kernel, and the engine's torch backend, against the format oracle for one case: a row
    of metrics (kernel vs oracle), with `failure` (the kernels' failure, str or None) and
    `backend_failure` (the torch backend's, str or None)."""
    from freetoken.kernels import nvfp4_linear, nvfp4_moe
    from freetoken.layers.quantization.nvfp4 import reference

    cache = {} if cache is None else cache
    w = weights_for(case, device, cache)
    truth = _oracle_weights(case, w, cache)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(device, dtype)
    if case.kind == "linear":
        want = oracle.linear(x, truth["weight"])
        backend = reference.reference_linear(x, **w)
        out = nvfp4_linear.nvfp4_linear(x, **w)
    else:
        weights, ids = _routing(case.tokens, case.experts, case.top_k, gen)
        weights, ids = weights.to(device, dtype), ids.to(device)
        want = oracle.moe(x, weights, ids, truth["w13"], truth["w2"])
        backend = reference.reference_moe(x, weights, ids, **w)
        out = nvfp4_moe.fused_moe(x, weights, ids, **w)
    row = _compare(case, out, want, dtype)
    row["backend_failure"] = truth["backend_failure"] or _backend_output(case, backend, want,
                                                                         dtype)
    return row


def _oracle_weights(case: KernelCase, w: dict, cache: dict) -> dict:
    """The format oracle's float32 weights for the case's weight set, and whether the torch
    backend dequantizes every one of them to the same bits (computed once per weight set)."""
    key = ("oracle", case.kind, case.experts, case.hidden, case.intermediate, case.tp)
    if key not in cache:
        cache[key] = (_oracle_linear(w) if case.kind == "linear" else _oracle_experts(w))
    return cache[key]


def _oracle_linear(w: dict) -> dict:
    from freetoken.layers.quantization.nvfp4 import reference

    truth = oracle.dequantize(w["packed"], w["block_scale"], w["global_scale"])
    got = reference.dequantize(w["packed"], w["block_scale"], w["global_scale"])
    return {"weight": truth, "backend_failure": _dequant_diff("weight", got, truth)}


def _oracle_experts(w: dict) -> dict:
    from freetoken.layers.quantization.nvfp4 import reference

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
    failure = _compare(case, backend, want, dtype, "torch backend output")["failure"]
    return f"{BACKEND} on the output: {failure}" if failure else None


def _compare(case: KernelCase, out: torch.Tensor, ref: torch.Tensor, dtype,
             what: str = "kernel output") -> dict:
    rtol, atol = TOLERANCE[dtype]
    ref64, out64 = ref.double().cpu(), out.double().cpu()
    rms = float(ref64.pow(2).mean().sqrt()) if ref64.numel() else 0.0
    cmp = compare_tensors(f"{case.label}: output", out64, ref64, rtol=rtol, atol=atol * rms)
    nonfinite = int((~torch.isfinite(out64)).sum()) if cmp.actual_shape is None else 0
    diff = (out64 - ref64).norm() if cmp.actual_shape is None else math.inf
    rel_l2 = float(diff / ref64.norm()) if ref64.norm() > 0 else float(diff)
    failure = None
    if not bool(torch.isfinite(ref64).all()):
        failure = f"{case.label}: the reference itself is not finite"
    elif nonfinite:
        failure = f"{case.label}: {nonfinite} non-finite values in the {what}"
    elif dtype in LOW_PRECISION_REL_L2 and cmp.actual_shape is None:
        if rel_l2 > LOW_PRECISION_REL_L2[dtype]:
            failure = (f"{case.label}: relative L2 {rel_l2:.2e} > allowed "
                       f"{LOW_PRECISION_REL_L2[dtype]:.0e} ({cmp.message()})")
        elif cmp.num_mismatched > (1 - MIN_WITHIN) * cmp.numel:
            failure = f"more than {100 * (1 - MIN_WITHIN):.1f}% mismatched: {cmp.message()}"
    elif not cmp.passed:
        failure = cmp.message()
    within = cmp.numel - cmp.num_mismatched
    return {"case": case.label, "max_abs": cmp.max_abs, "rel_l2": rel_l2, "within": within,
            "numel": cmp.numel, "failure": failure}


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


def _on_rank(rank_ctx, dtype_name: str) -> dict | None:
    """Runs on every rank; rank 0 runs the matrix, the others idle."""
    if rank_ctx.rank != 0:
        return None
    device = torch.device(rank_ctx.device)
    if device.type == "cuda":
        dtype = torch.bfloat16 if dtype_name == "auto" else getattr(torch, dtype_name)
        cases = gpu_matrix()
    else:
        from freetoken.kernels import use_interpreter

        use_interpreter()
        dtype, cases = torch.float32, cpu_matrix()
    return {"rows": run_matrix(cases, device, dtype),
            "dtype": str(dtype).removeprefix("torch.")}


def run(ctx: CheckContext) -> CheckResult:
    start = time.monotonic()
    key = ("kernels", ctx.tp)
    if key in ctx.cache:
        return CheckResult("kernels", ctx.case.name, ctx.tp, "skip", 0.0, ctx.placement, {},
                           f"kernel matrix already run at tp={ctx.tp} (with {ctx.cache[key]})")
    ctx.cache[key] = ctx.case.name
    value = ctx.runner.run(_on_rank, ctx.options.dtype)[0].value
    metrics, _ = summarize(value["rows"])
    message = verdict(value["rows"], value["dtype"])
    status = "fail" if message else "pass"
    message = f"{ctx.case.name} tp={ctx.tp}: {message}" if message else ""
    return CheckResult("kernels", ctx.case.name, ctx.tp, status, time.monotonic() - start,
                       ctx.placement, metrics, message)
