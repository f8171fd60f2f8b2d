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


# Elements tested per step (isfinite builds a float and two bool temporaries of the input's
# size): over a whole shard that transient would be more than its bytes again, which the
# memory check's load budget (rightly) refuses.
_CHUNK = 1 << 16


def _has_nonfinite(t: torch.Tensor) -> bool:
    if not t.is_contiguous():
        return any(_has_nonfinite(part) for part in t)
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        bad = _nonfinite_mask(flat[start : start + _CHUNK])
        if bad is None:
            return False
        if bool(bad.any()):
            return True
    return False


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise NonFiniteError naming checkpoint tensor `name` if its loaded shard `t` holds
    NaN or Inf (counts and the first flat index in the message)."""
    if not _has_nonfinite(t):
        return
    flat = _nonfinite_mask(t).flatten()
    values = t.flatten()[flat].float()
    kinds = [f"{n} {label}" for label, n in (("NaN", int(values.isnan().sum())),
                                             ("Inf", int(values.isinf().sum()))) if n]
    first = int(flat.nonzero()[0])
    raise NonFiniteError(f"checkpoint tensor {name!r} holds {' and '.join(kinds)} "
                         f"(of {t.numel()} values in this rank's shard; first at flat index "
                         f"{first})")
