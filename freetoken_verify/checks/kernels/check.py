"""kernels: the Triton kernels and the quantized GEMMs against references, over matrices of
TP-local shapes. Three parts, one row per TP size:

- NVFP4 (`freetoken_verify.checks.kernels.nvfp4`, cases in
  `freetoken_verify.checks.kernels.nvfp4_cases`): the NVFP4 MoE and linear kernels and the
  engine's torch NVFP4 backend against an oracle computed from the format definition; a
  backend bug is blamed on the backend.
- Engine kernels (`freetoken_verify.checks.kernels.engine`, cases in
  `freetoken_verify.checks.kernels.engine_cases`): paged attention (decode and varlen prefill
  reading the block table), the KV write, bf16 fused MoE with its routing and expert alignment,
  GatedDeltaNet's fused decode step and conv update, RMSNorm, gated RMSNorm, SiLU-and-mul and
  rotary, each against the torch path the engine runs on CPU, at the heads, KV heads (replicated
  where fewer than ranks), GatedDeltaNet heads and intermediate sizes each bundled case has per rank
  at TP 1, 2, 4 and 8 (and on GPU Qwen3.5-MoE's real dimensions: head_dim 256, 16 / 2 heads, 16 x
  128 key and 32 x 128 value heads, 256 experts top-8, I = 512, hidden 2048).
- Quantized GEMMs (`freetoken_verify.checks.kernels.quant`, cases in
  `freetoken_verify.checks.kernels.quant_cases`): every weight-only GEMM the engine has (NVFP4
  dense in both scale conventions, FP8 per tensor, FP8 block, routed experts in block FP8 and
  NVFP4), built through the engine's linear methods and called as an engine step calls them
  (the torch path on CPU, whatever the engine dispatches to on CUDA), against a float64 oracle
  from the format definitions, on the last rank of each TP size: a fixed matrix (56 cases on
  CPU, about 1.5 s) and every quantized destination of the model under verification.

It verifies kernels, not the case's model: it runs every TP size's shapes once per run, for the
first row (first TP size, first model), on rank 0 only (other ranks idle), and a quantized
model's own GEMMs once per model; other rows report `skip`. A run that does not name it leaves
the Triton matrices out on CPU ranks unless an injected fault they catch is in play (the
engine's CPU path runs no Triton kernel; `VerifyOptions.kernel_matrices`, `build_plan`), and
leaves the check out when no model is quantized either.

GPU: bf16 activations (or --dtype); NVFP4 the full product of its axes, engine kernels every
distinct shape of every model. CPU: the Triton interpreter, float32 activations (it computes
bf16 arithmetic wrongly), and reduced matrices because it runs programs one by one in numpy:
NVFP4 one decode and one prefill case per TP size (every tokens value, and every experts,
top-k and hidden value in each path); engine kernels one case per kernel and TP size, the
models taking turns (about 15 s and 5 s of CPU time per TP size). The interpreter is switched
on inside the rank process (`freetoken.kernels.use_interpreter`, before the first kernel import,
which fixes the process's kernel mode): rank groups are started once per TP size for every
check, so the check cannot give its ranks a different environment.

Per output: NaN / Inf fail it; elements are compared with |out - ref| <= atol * rms(ref) + rtol *
|ref| (`freetoken_verify.checks.kernels.judge`, the numbers in
`freetoken_verify.compare.tolerances`); copies, integer results (expert ids, alignment
rows) and state outside the batch must be equal bit for bit. float32: 1e-4 / 1e-4, every element
within; kernel and reference differ in summation order only (measured: relative L2 at most 3e-7 on
the engine kernels). bf16 / fp16 (GPU): 2e-2 / 2e-2 with at least 99.9 % of elements within and
relative L2 at most 1e-2 (bf16) or 5e-3 (fp16). The references run in float32 (NVFP4: float64) on
the same bf16 inputs, so what is left is the kernels' own rounding: the output rounded once (a
relative error of at most 2^-9 per element), and inside, attention's probabilities rounded to bf16
before the PV product, the MoE's SiLU(gate) * up rounded to bf16 before the down projection, the
gated delta rule's output from an fp32 state. Each such rounding moves an element by at most 2^-9 of
its terms, so relative L2 stays at a few 1e-3 (NVFP4 measured on an H200: 3e-3, and 1 element in
131072 off by a whole bf16 ulp of the terms where large terms cancel, which the 99.9 % allows),
while every injected kernel bug moves relative L2 by 0.3 or more.

Metrics: max_abs, rel_l2 (worst case) and pct_within_tol (all elements) over both parts, cases
and failed_cases over both, backend_failed_cases (the torch NVFP4 backend vs the oracle), and
`families`: the same per kernel family (nvfp4: MoE and linear, paged_attention, fused_moe,
delta_rule, norm_rope, quantized with a breakdown per format), in the JSON report.
"""

from __future__ import annotations

import time

import torch

from freetoken.kernels import use_interpreter
from freetoken_verify.checks.base import CheckContext, make_result
from freetoken_verify.checks.kernels import engine as engine
from freetoken_verify.checks.kernels import engine_cases as engine_kernel_cases
from freetoken_verify.checks.kernels import quant
from freetoken_verify.checks.kernels.nvfp4 import run_case, run_matrix, summarize, verdict
from freetoken_verify.checks.kernels.nvfp4_cases import (
    KernelCase,
    cpu_matrix,
    gpu_matrix,
    make_experts,
)
from freetoken_verify.checks.kernels.quant_cases import fixed_matrix, model_matrix, with_tokens
from freetoken_verify.checks.quant_layout import LayoutError
from freetoken_verify.report.formats import CheckResult

__all__ = ["KernelCase", "cpu_matrix", "gpu_matrix", "make_experts", "run", "run_case",
           "run_matrix", "summarize", "verdict"]


def _on_rank(rank_ctx, dtype_name: str, model_cases: list, shared: bool,
             triton: bool = True) -> dict | None:
    """Runs on every rank; rank 0 runs the matrices (with `shared`, the model-independent
    ones, the Triton kernel matrices only with `triton`; always the model's quantized cases),
    the others idle."""
    if rank_ctx.rank != 0:
        return None
    device = torch.device(rank_ctx.device)
    if device.type == "cuda":
        dtype = torch.bfloat16 if dtype_name == "auto" else getattr(torch, dtype_name)
        nvfp4, cases = gpu_matrix(), engine_kernel_cases.gpu_matrix()
    else:
        use_interpreter()
        dtype, nvfp4, cases = torch.float32, cpu_matrix(), engine_kernel_cases.cpu_matrix()
    quantized = (fixed_matrix(device.type) if shared else []) + with_tokens(model_cases,
                                                                            device.type)
    if not (shared and triton):
        nvfp4, cases = [], []
    return {"rows": run_matrix(nvfp4, device, dtype),
            "engine_rows": engine.run_matrix(cases, device, dtype),
            "quant_rows": quant.run_matrix(quantized, device, dtype),
            "dtype": str(dtype).removeprefix("torch.")}


def metrics(nvfp4_rows: list[dict], engine_rows: list[dict],
            quant_rows: list[dict] | None = None) -> dict:
    """Every part's metrics: overall, and per kernel family under `families` (the quantized
    GEMMs also per format)."""
    quant_rows = quant_rows or []
    nvfp4, _ = summarize(nvfp4_rows)
    families = {}
    if nvfp4_rows or not quant_rows:
        families["nvfp4"] = {k: v for k, v in nvfp4.items() if k != "backend_failed_cases"}
    families.update(engine.family_metrics(engine_rows))
    families.update(quant.family_metrics(quant_rows))
    rows = nvfp4_rows + engine_rows + quant_rows
    numel = sum(r["numel"] for r in rows)
    return {"max_abs": max((r["max_abs"] for r in rows), default=0.0),
            "rel_l2": max((r["rel_l2"] for r in rows), default=0.0),
            "pct_within_tol": 100.0 * sum(r["within"] for r in rows) / max(numel, 1),
            "cases": len(rows), "failed_cases": sum(1 for r in rows if r["failure"]),
            "backend_failed_cases": nvfp4["backend_failed_cases"], "families": families}


def run(ctx: CheckContext) -> CheckResult:
    start = time.monotonic()
    # The matrices hold every TP size's local shapes and do not depend on the model: once
    # per run, on the first row; a quantized model's own GEMMs once per model.
    state = ctx.state
    try:
        model_cases = model_matrix(ctx.case.model_config, ctx.case.name)
    except LayoutError as e:
        return make_result("kernels", ctx, start, "fail",
                           message=f"{ctx.case.name} tp={ctx.tp}: {e}")
    if ctx.case.name in state.kernel_models:
        model_cases = []
    shared = state.kernel_matrices_ran is None
    if not shared and not model_cases:
        return make_result("kernels", ctx, start, "skip",
                           message="kernel matrix (every TP size's shapes) already run in this "
                                   "run, at tp={} with {}".format(*state.kernel_matrices_ran))
    if shared:
        state.kernel_matrices_ran = (ctx.tp, ctx.case.name)
    state.kernel_models.add(ctx.case.name)
    value = ctx.runner.run(_on_rank, ctx.options.dtype, model_cases, shared,
                           ctx.options.kernel_matrices)[0].value
    parts = [verdict(value["rows"], value["dtype"]),
             engine.verdict(value["engine_rows"], value["dtype"]),
             quant.verdict(value["quant_rows"], value["dtype"])]
    message = "; ".join(p for p in parts if p)
    status = "fail" if message else "pass"
    message = f"{ctx.case.name} tp={ctx.tp}: {message}" if message else ""
    return make_result("kernels", ctx, start, status,
                       metrics(value["rows"], value["engine_rows"], value["quant_rows"]),
                       message)
