"""How the `kernels` check judges a kernel output against its reference, for the NVFP4 and the
engine kernels alike (tolerances in `freetoken_verify.compare.tolerances`, justified in
`freetoken_verify.checks.kernels.check`)."""

from __future__ import annotations

import math

import torch

from freetoken_verify.compare import (
    KERNEL_MIN_WITHIN,
    KERNEL_TOLERANCES,
    Comparison,
    compare_tensors,
    rel_l2,
)


def compare_output(label: str, out: torch.Tensor, ref: torch.Tensor, dtype,
                   what: str = "kernel output") -> dict:
    """One output against its reference: elements within |out - ref| <= atol * rms(ref) +
    rtol * |ref| (every one in float32; in bf16 / fp16 the relative L2 error bounded and at
    least KERNEL_MIN_WITHIN of them), non-finite values failing. A row of metrics with
    `failure` (a one-line message starting with `label`, or None)."""
    tol = KERNEL_TOLERANCES[dtype]
    ref64, out64 = ref.detach().double().cpu(), out.detach().double().cpu()
    rms = float(ref64.pow(2).mean().sqrt()) if ref64.numel() else 0.0
    cmp = compare_tensors(f"{label}: {what}", out64, ref64, rtol=tol.rtol, atol=tol.atol * rms)
    nonfinite = int((~torch.isfinite(out64)).sum()) if cmp.actual_shape is None else 0
    error = _relative_error(out64, ref64, cmp)
    failure = None
    if not bool(torch.isfinite(ref64).all()):
        failure = f"{label}: the reference itself is not finite"
    elif nonfinite:
        failure = f"{label}: {nonfinite} non-finite values in the {what}"
    elif tol.max_rel_l2 is not None and cmp.actual_shape is None:
        if error > tol.max_rel_l2:
            failure = (f"{cmp.name}: rel L2 {error:.2g} > allowed {tol.max_rel_l2:.0e} "
                       f"({cmp.message().removeprefix(cmp.name + ': ')})")
        elif cmp.num_mismatched > (1 - KERNEL_MIN_WITHIN) * cmp.numel:
            failure = (f"{_with_rel_l2(cmp.name, cmp.message(), error)}; at most "
                       f"{100 * (1 - KERNEL_MIN_WITHIN):.1f}% may mismatch")
    elif not cmp.passed:
        failure = _with_rel_l2(cmp.name, cmp.message(), error)
    within = cmp.numel - cmp.num_mismatched
    return {"case": label, "max_abs": cmp.max_abs, "rel_l2": error, "within": within,
            "numel": cmp.numel, "failure": failure}


def _relative_error(out64: torch.Tensor, ref64: torch.Tensor, cmp: Comparison) -> float:
    """`rel_l2` of the output, inf for a shape mismatch. A reference of norm 0 (all zeros, or
    NaN) is the kernels check's own case: its rows record the absolute L2 error there, not
    rel_l2's inf, so a zero-output case that matches records 0 and one that does not records
    how far off it is."""
    if cmp.actual_shape is not None:
        return math.inf
    if not float(ref64.norm()) > 0:
        return float((out64 - ref64).norm())
    return rel_l2(out64, ref64)


def _with_rel_l2(name: str, message: str, rel_l2: float) -> str:
    """`name: rel L2 0.41, 9 / 64 mismatched ...`: the error's size first, then where."""
    if math.isinf(rel_l2):
        return message
    return f"{name}: rel L2 {rel_l2:.2g}, {message.removeprefix(name + ': ')}"
