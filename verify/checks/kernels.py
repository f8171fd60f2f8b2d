"""kernels: the NVFP4 Triton kernels (routed-expert MoE, decode and prefill paths, and the dense
linear) against the torch reference (`freetoken.layers.quantization.nvfp4.reference`: table
dequantization, float32 matmul), over a matrix of shapes. It verifies kernels, not the case's
model: it runs for the first model of each TP size, on rank 0 only (other ranks idle), and
reports `skip` for the other models.

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
rank process (`freetoken.kernels.use_interpreter`, before the first launch, re-importing a
kernel module imported earlier as compiled code): rank groups are started once per TP size for
every check, so the check cannot give its ranks a different environment.

Per case: NaN / Inf in the kernel output fail it; elements are compared with
|out - ref| <= atol * rms(ref) + rtol * |ref| (float32: 1e-4 / 1e-4, differences come from
summation order only; bf16: 2e-2 / 2e-2, the output and SiLU(gate) * up are rounded to bf16).
float32 requires every element within; bf16 / fp16 require the relative L2 error within
LOW_PRECISION_REL_L2 and at least 99.9 % of elements within: rounding SiLU(gate) * up to bf16
before the down projection moves a few elements where large terms cancel by a whole bf16 ulp
of the terms (measured on an H200: 1 element in 131072 off by 1.0, relative L2 3e-3), while
every injected kernel bug moves relative L2 by 0.3 or more.
Metrics: max_abs and rel_l2 (worst case), pct_within_tol (all elements), cases, failed_cases.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch

from verify.checks import CheckContext
from verify.compare import compare_tensors
from verify.report import CheckResult

TP_SIZES = (1, 2, 4, 8)
TOKENS = (1, 7, 64, 300)
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2),
             torch.float16: (1e-2, 1e-2)}
LOW_PRECISION_REL_L2 = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
MIN_WITHIN = 0.999


@dataclass(frozen=True)
class KernelCase:
    """One kernel launch to check. kind "moe": `experts`, `top_k`; kind "linear": a dense
    [intermediate / tp, hidden] weight (experts = top_k = 1)."""

    kind: str
    tokens: int
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    tp: int

    @property
    def local_intermediate(self) -> int:
        return self.intermediate // self.tp

    @property
    def label(self) -> str:
        shape = f"tokens={self.tokens} hidden={self.hidden} " \
                f"I={self.intermediate}/tp{self.tp}={self.local_intermediate}"
        if self.kind == "linear":
            return f"linear {shape}"
        return f"moe experts={self.experts} top_k={self.top_k} {shape}"


def gpu_matrix(hiddens=(2048, 1040), intermediate=512) -> list[KernelCase]:
    """The full product on GPU, plus a dense linear per tokens x hidden."""
    cases = [KernelCase("moe", t, e, k, h, intermediate, tp) for t, e, k, h, tp
             in itertools.product(TOKENS, (8, 64), (1, 2, 8), hiddens, TP_SIZES) if k <= e]
    return cases + [KernelCase("linear", t, 1, 1, h, intermediate, 1)
                    for t, h in itertools.product(TOKENS, hiddens)]


def cpu_matrix(hiddens=(64, 48), intermediate=128) -> list[KernelCase]:
    """Each tokens x tp pair once, top-k and hidden cycling; 64 experts (the slowest to
    interpret) in 3 cases, one per top-k; 4 linear cases."""
    cases = []
    for i, (t, tp) in enumerate(itertools.product(TOKENS, TP_SIZES)):
        cases.append(KernelCase("moe", t, 64 if i % 5 == 1 else 8, (1, 2, 8)[i % 3],
                                hiddens[(i // 2) % 2], intermediate, tp))
    return cases + [KernelCase("linear", t, 1, 1, hiddens[i % 2], intermediate, 1)
                    for i, t in enumerate(TOKENS)]


def _heavy_tailed(shape, scale: float, gen: torch.Generator) -> torch.Tensor:
    # Student-t (4 dof) by ratio of normals and chi-square: outliers set realistic amaxes.
    device = gen.device
    z = torch.randn(shape, generator=gen, device=device)
    chi2 = torch.randn((4, *shape), generator=gen, device=device).pow(2).sum(0)
    return z / torch.sqrt(chi2 / 4) * scale


def _quantized_shard(w: torch.Tensor, tp: int, rows: bool) -> tuple:
    """Quantize a full checkpoint weight, then take rank 0's shard as the loader would."""
    from freetoken.layers.quantization.nvfp4.quantizer import quantize
    from freetoken.layers.quantization.nvfp4.specs import PACKED, SCALE, InputSplit
    from freetoken.loading.specs import Split

    q = quantize(w)
    packed_spec, scale_spec = (Split(0), Split(0)) if rows else \
        (InputSplit(PACKED, 1), InputSplit(SCALE, 1))
    return (packed_spec.shard(q.packed, 0, tp, "packed"),
            scale_spec.shard(q.block_scale, 0, tp, "block_scale"), q.global_scale)


def make_experts(experts: int, hidden: int, intermediate: int, tp: int, seed: int,
                 device="cpu") -> dict:
    """Rank 0's NVFP4 expert tensors for `tp` ranks, named as `fused_moe` takes them,
    generated and quantized on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    parts = {k: [] for k in ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")}
    for _ in range(experts):
        spread = float(torch.empty((), device=device).log_normal_(0.0, 0.5, generator=gen))
        gate = _heavy_tailed((intermediate, hidden), spread / math.sqrt(hidden), gen)
        up = _heavy_tailed((intermediate, hidden), spread / math.sqrt(hidden), gen)
        ratio = 1.8 + 1.2 * float(torch.rand((), generator=gen, device=device))
        up *= ratio * gate.abs().max() / up.abs().max()
        down = _heavy_tailed((hidden, intermediate), 1.0 / math.sqrt(intermediate), gen)
        (gp, gs, gg), (upk, us, ug) = (_quantized_shard(m, tp, True) for m in (gate, up))
        dp, ds, dg = _quantized_shard(down, tp, False)
        for key, value in zip(parts, (torch.cat([gp, upk]), torch.cat([gs, us]),
                                      torch.stack([gg, ug]), dp, ds, dg)):
            parts[key].append(value)
    return {k: torch.stack(v) for k, v in parts.items()}


def _weights_for(case: KernelCase, device, cache: dict) -> dict:
    """The case's weights, shared by every case of the same shape (quantizing 64 experts at
    H = 2048 costs more than the kernels)."""
    key = (case.kind, case.experts, case.hidden, case.intermediate, case.tp)
    if key not in cache:
        seed = sum(key[1:]) * 7919 + len(case.kind)
        if case.kind == "linear":
            from freetoken.layers.quantization.nvfp4.quantizer import quantize

            gen = torch.Generator(device=device).manual_seed(seed)
            shape = (case.local_intermediate, case.hidden)
            q = quantize(_heavy_tailed(shape, 1.0 / math.sqrt(case.hidden), gen))
            cache[key] = {"packed": q.packed, "block_scale": q.block_scale,
                          "global_scale": q.global_scale}
        else:
            cache[key] = make_experts(case.experts, case.hidden, case.intermediate, case.tp,
                                      seed, device)
    return cache[key]


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    from freetoken.layers.moe import route

    logits = torch.randn(tokens, experts, generator=gen) * 2.0
    return route(logits, top_k, renormalize=True, dtype=torch.float32)


def run_case(case: KernelCase, device, dtype: torch.dtype, seed: int,
             cache: dict | None = None) -> dict:
    """Kernel vs reference for one case: a row of metrics, with `failure` (str or None)."""
    from freetoken.kernels import nvfp4_linear, nvfp4_moe
    from freetoken.layers.quantization.nvfp4 import reference

    w = _weights_for(case, device, {} if cache is None else cache)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(device, dtype)
    if case.kind == "linear":
        ref = reference.reference_linear(x, **w)
        out = nvfp4_linear.nvfp4_linear(x, **w)
    else:
        weights, ids = _routing(case.tokens, case.experts, case.top_k, gen)
        weights, ids = weights.to(device, dtype), ids.to(device)
        ref = reference.reference_moe(x, weights, ids, **w)
        out = nvfp4_moe.fused_moe(x, weights, ids, **w)
    return _compare(case, out, ref, dtype)


def _compare(case: KernelCase, out: torch.Tensor, ref: torch.Tensor, dtype) -> dict:
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
        failure = f"{case.label}: {nonfinite} non-finite values in the kernel output"
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
                   "numel": 1, "failure": f"{case.label}: {type(e).__name__}: {e}"}
        row["seconds"] = time.monotonic() - start
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> tuple[dict, list[str]]:
    """Metrics over all cases and the failures, in case order."""
    failures = [r["failure"] for r in rows if r["failure"]]
    numel = sum(r["numel"] for r in rows)
    metrics = {"max_abs": max((r["max_abs"] for r in rows), default=0.0),
               "rel_l2": max((r["rel_l2"] for r in rows), default=0.0),
               "pct_within_tol": 100.0 * sum(r["within"] for r in rows) / max(numel, 1),
               "cases": len(rows), "failed_cases": len(failures)}
    return metrics, failures


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
    metrics, failures = summarize(value["rows"])
    status = "fail" if failures else "pass"
    message = ""
    if failures:
        message = (f"{ctx.case.name} tp={ctx.tp}: kernels in {value['dtype']}: "
                   f"{len(failures)} / {len(value['rows'])} cases fail; first: {failures[0]}")
    return CheckResult("kernels", ctx.case.name, ctx.tp, status, time.monotonic() - start,
                       ctx.placement, metrics, message)
