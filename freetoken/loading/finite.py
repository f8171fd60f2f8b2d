"""Non-finite checkpoint values, caught at load: a NaN weight or scale otherwise loads
silently and surfaces as garbage text or as a logit mismatch that does not say why. Checked
on the loaded shard, on the device it went to: one pass over memory the copy just touched."""

from __future__ import annotations

import torch

# fp8 formats torch cannot test with isfinite on every device: their non-finite bit patterns.
_FP8_NONFINITE = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}


class NonFiniteError(ValueError):
    """A checkpoint tensor holds NaN or Inf."""


def _nonfinite_mask(t: torch.Tensor) -> torch.Tensor | None:
    if t.dtype in _FP8_NONFINITE:
        mask, pattern = _FP8_NONFINITE[t.dtype]
        return (t.view(torch.uint8) & mask) == pattern
    if t.dtype.is_floating_point:
        return ~torch.isfinite(t)
    return None  # integer and packed tensors (NVFP4 codes) have no non-finite values


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise NonFiniteError naming checkpoint tensor `name` if its loaded shard `t` holds
    NaN or Inf (counts and the first flat index in the message)."""
    bad = _nonfinite_mask(t)
    if bad is None or not bool(bad.any()):
        return
    flat = bad.flatten()
    values = t.flatten()[flat].float()
    kinds = [f"{n} {label}" for label, n in (("NaN", int(values.isnan().sum())),
                                             ("Inf", int(values.isinf().sum()))) if n]
    first = int(flat.nonzero()[0])
    raise NonFiniteError(f"checkpoint tensor {name!r} holds {' and '.join(kinds)} "
                         f"(of {t.numel()} values in this rank's shard; first at flat index "
                         f"{first})")
