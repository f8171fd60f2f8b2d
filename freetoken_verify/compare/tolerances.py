"""Every numeric allowance the harness judges by, keyed by check and then by dtype: golden's
logit tolerances, the kernels check's element and relative-L2 bounds, bisect's per-module
bounds. One place, so a reader can compare them and a change to one is seen next to the others.

The measurements behind them: golden in docs/verification.md, kernels in
`freetoken_verify.checks.kernels.check`'s docstring, bisect in
`freetoken_verify.checks.bisect.check`'s."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """Allowed error for one dtype: elementwise (rtol, atol) and logit noise for near-ties.

    With `max_rel_l2` set (low-precision dtypes) logits are judged as distributions instead of
    element by element: relative L2 and mean KL(reference || engine) bounded, and every top-1
    disagreement must be a near-tie in the reference. Elementwise mismatches are still counted
    and reported."""

    rtol: float
    atol: float
    logit_noise: float
    max_rel_l2: float | None = None
    max_kl: float | None = None


# golden, logits by dtype.
# fp32: TP only changes the order of reductions; relative errors of ~1e-6 on logits of magnitude
# ~5 are what TP runs show, so 1e-4 leaves headroom without hiding a wrong shard.
# bf16: an 8-bit mantissa (~4e-3 per rounding) and TP changes the rounding of every partial sum,
# which compounds over layers; logits can move by a few tenths.
# fp16: 11-bit mantissa, in between.
# On a large vocabulary (248k) a few tenths of drift leave some elements outside any fixed
# elementwise band while the distribution is intact, so bf16 / fp16 are judged by relative L2,
# KL and near-tie-only top-1 flips (docs/verification.md has the measurements).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rtol=1e-4, atol=1e-4, logit_noise=1e-3),
    torch.bfloat16: Tolerance(rtol=5e-2, atol=5e-2, logit_noise=0.25, max_rel_l2=5e-2,
                              max_kl=5e-2),
    torch.float16: Tolerance(rtol=1e-2, atol=1e-2, logit_noise=5e-2, max_rel_l2=1e-2,
                             max_kl=1e-2),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """Return golden's tolerance for `dtype`; ValueError for a dtype with no entry."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in TOLERANCES)
        raise ValueError(f"no tolerance for dtype {dtype}; known dtypes: {known}") from None


@dataclass(frozen=True)
class KernelTolerance:
    """The kernels check's allowance for one activation dtype: an element is within when
    |out - ref| <= atol * rms(ref) + rtol * |ref|; with `max_rel_l2` set (bf16 / fp16) the
    relative L2 error is bounded and at least `KERNEL_MIN_WITHIN` of the elements must be
    within, else every one must."""

    rtol: float
    atol: float
    max_rel_l2: float | None = None


# kernels, by activation dtype: float32 kernel and reference differ in summation order only;
# bf16 / fp16 keep the kernels' own roundings (the justification is the kernels check's).
KERNEL_TOLERANCES: dict[torch.dtype, KernelTolerance] = {
    torch.float32: KernelTolerance(rtol=1e-4, atol=1e-4),
    torch.bfloat16: KernelTolerance(rtol=2e-2, atol=2e-2, max_rel_l2=1e-2),
    torch.float16: KernelTolerance(rtol=1e-2, atol=1e-2, max_rel_l2=5e-3),
}
KERNEL_MIN_WITHIN = 0.999

# bisect, per module output (relative L2): float32 everywhere; bf16 / fp16 LOW_FACTOR times
# HF's own error at that module, at least LOW_FLOOR (else the bound golden puts on the logits).
BISECT_FP32_BOUND = 1e-3
BISECT_LOW_FLOOR, BISECT_LOW_FACTOR = 2e-2, 3.0
