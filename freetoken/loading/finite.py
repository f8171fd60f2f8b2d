"""Non-finite checkpoint values, caught at load: a NaN weight or scale otherwise loads
silently and surfaces as garbage text or as a logit mismatch that does not say why. Checked
on the loaded shard, on the device it went to: one pass over memory the copy just touched.

The pass is a sum: NaN and Inf propagate through it, so a finite sum clears the tensor in one
reduction without temporaries and, on a GPU, without a host sync per tensor. A non-finite sum
is confirmed element-wise (a sum of large finite values can overflow) before anything is
reported."""

from __future__ import annotations

from collections.abc import Sequence

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


# Elements tested per step where a step builds temporaries of its input's size (the exact
# test, fp8 masks, float16 sums in float32): over a whole shard that transient would be more
# than its bytes again, which the memory check's load budget (rightly) refuses; a MiB of
# mask per step fits its slack and keeps the launches few on a whole parameter.
_CHUNK = 1 << 20


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    flat = t.reshape(-1) if t.is_contiguous() else t.flatten()
    return [flat[start : start + _CHUNK] for start in range(0, flat.numel(), _CHUNK)]


def _screen(t: torch.Tensor) -> torch.Tensor | None:
    """A 0-dim float tensor on t's device, finite if every value of `t` is (not always the
    converse); None for dtypes without non-finite values."""
    if t.dtype in _FP8_NONFINITE:
        bad = torch.stack([_nonfinite_mask(c).any() for c in _chunks(t)]).any()
        return torch.where(bad, float("nan"), 0.0)
    if not t.dtype.is_floating_point or t.numel() == 0:
        return None
    if t.dtype == torch.float16:
        # float16's own range overflows at 65504: sum in float32, a chunk at a time.
        return torch.stack([c.sum(dtype=torch.float32) for c in _chunks(t)]).sum()
    # bfloat16 and float32 sums keep float32's exponent range.
    return t.sum()


def _has_nonfinite(t: torch.Tensor) -> bool:
    """The exact element-wise test."""
    if t.dtype not in _FP8_NONFINITE and not t.dtype.is_floating_point:
        return False
    return any(bool(_nonfinite_mask(c).any()) for c in _chunks(t))


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise NonFiniteError naming checkpoint tensor `name` if its loaded shard `t` holds
    NaN or Inf (counts and the first flat index in the message)."""
    check_finite_grouped([(t, [(name, t)])])


def check_finite_grouped(groups: Sequence[tuple[torch.Tensor, Sequence[tuple[str, torch.Tensor]]]]
                         ) -> None:
    """check_finite over groups of (name, shard) pairs that together make up one tensor each
    (the shards of one parameter): one screening reduction per group's tensor and one host
    sync for all of them; only a group that fails is tested shard by shard, so the error
    still names the checkpoint tensor (the first non-finite one, in order)."""
    screened = [(parts, s) for whole, parts in groups if (s := _screen(whole)) is not None]
    if not screened:
        return
    sums = torch.stack([s.to(device=screened[0][1].device, dtype=torch.float32)
                        for _, s in screened])
    if bool(torch.isfinite(sums).all()):
        return
    for (parts, _), ok in zip(screened, torch.isfinite(sums).tolist()):
        for name, t in [] if ok else parts:
            if _has_nonfinite(t):
                _raise(name, t)


def _raise(name: str, t: torch.Tensor) -> None:
    flat = _nonfinite_mask(t).flatten()
    values = t.flatten()[flat].float()
    kinds = [f"{n} {label}" for label, n in (("NaN", int(values.isnan().sum())),
                                             ("Inf", int(values.isinf().sum()))) if n]
    first = int(flat.nonzero()[0])
    raise NonFiniteError(f"checkpoint tensor {name!r} holds {' and '.join(kinds)} "
                         f"(of {t.numel()} values in this rank's shard; first at flat index "
                         f"{first})")
