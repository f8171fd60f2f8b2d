"""How the `kernels` check judges a kernel output against its reference, for the NVFP4 and the
engine kernels alike (tolerances justified in `freetoken_verify.checks.kernels.check`)."""

from __future__ import annotations

import math

import torch

from freetoken_verify.compare import compare_tensors

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2),
             torch.float16: (1e-2, 1e-2)}
LOW_PRECISION_REL_L2 = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
MIN_WITHIN = 0.999


def compare_output(label: str, out: torch.Tensor, ref: torch.Tensor, dtype,
                   what: str = "kernel output") -> dict:
    """One output against its reference: elements within |out - ref| <= atol * rms(ref) +
    rtol * |ref| (every one in float32; in bf16 / fp16 the relative L2 error bounded and at
    least MIN_WITHIN of them), non-finite values failing. A row of metrics with `failure`
    (a one-line message starting with `label`, or None)."""
    rtol, atol = TOLERANCE[dtype]
    ref64, out64 = ref.detach().double().cpu(), out.detach().double().cpu()
    rms = float(ref64.pow(2).mean().sqrt()) if ref64.numel() else 0.0
    cmp = compare_tensors(f"{label}: {what}", out64, ref64, rtol=rtol, atol=atol * rms)
    nonfinite = int((~torch.isfinite(out64)).sum()) if cmp.actual_shape is None else 0
    diff = (out64 - ref64).norm() if cmp.actual_shape is None else math.inf
    rel_l2 = float(diff / ref64.norm()) if ref64.norm() > 0 else float(diff)
    failure = None
    if not bool(torch.isfinite(ref64).all()):
        failure = f"{label}: the reference itself is not finite"
    elif nonfinite:
        failure = f"{label}: {nonfinite} non-finite values in the {what}"
    elif dtype in LOW_PRECISION_REL_L2 and cmp.actual_shape is None:
        if rel_l2 > LOW_PRECISION_REL_L2[dtype]:
            failure = (f"{cmp.name}: rel L2 {rel_l2:.2g} > allowed "
                       f"{LOW_PRECISION_REL_L2[dtype]:.0e} "
                       f"({cmp.message().removeprefix(cmp.name + ': ')})")
        elif cmp.num_mismatched > (1 - MIN_WITHIN) * cmp.numel:
            failure = (f"{_with_rel_l2(cmp.name, cmp.message(), rel_l2)}; at most "
                       f"{100 * (1 - MIN_WITHIN):.1f}% may mismatch")
    elif not cmp.passed:
        failure = _with_rel_l2(cmp.name, cmp.message(), rel_l2)
    within = cmp.numel - cmp.num_mismatched
    return {"case": label, "max_abs": cmp.max_abs, "rel_l2": rel_l2, "within": within,
            "numel": cmp.numel, "failure": failure}


def _with_rel_l2(name: str, message: str, rel_l2: float) -> str:
    """`name: rel L2 0.41, 9 / 64 mismatched ...`: the error's size first, then where."""
    if math.isinf(rel_l2):
        return message
    return f"{name}: rel L2 {rel_l2:.2g}, {message.removeprefix(name + ': ')}"
