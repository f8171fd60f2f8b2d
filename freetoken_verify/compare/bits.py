"""Bit-for-bit comparison: which elements of two tensors of one dtype differ, and by how many
ulps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float64: torch.int64,
                   torch.bfloat16: torch.int16, torch.float16: torch.int16}


def ulp_order(t: torch.Tensor) -> torch.Tensor:
    """Each float as an int64 position on the number line of its dtype: neighbouring floats
    are 1 apart (and +0 and -0 both 0), so the difference of two is their distance in ulps."""
    bits = t.contiguous().view(_SAME_WIDTH_INT[t.dtype]).to(torch.int64)
    lowest = torch.iinfo(_SAME_WIDTH_INT[t.dtype]).min
    return torch.where(bits < 0, lowest - bits, bits)


@dataclass(frozen=True)
class BitDifference:
    """How two floating tensors of one dtype and shape differ bit for bit: `count` of `numel`
    elements, the largest distance `max_ulp` in ulps of their dtype, at `where`, with the two
    values there."""

    count: int
    numel: int
    max_ulp: int
    where: tuple[int, ...]
    got: float
    want: float

    def describe(self) -> str:
        return (f"{self.count} / {self.numel} elements differ bit for bit, largest "
                f"{self.max_ulp} ulp at {self.where} ({self.got:.9g} vs {self.want:.9g})")


def bit_difference(got: torch.Tensor, want: torch.Tensor) -> BitDifference | None:
    """None when the floating tensors `got` and `want` (same dtype and shape) hold the same
    bits; else how they differ."""
    differ = got.contiguous().view(_SAME_WIDTH_INT[got.dtype]) != \
        want.contiguous().view(_SAME_WIDTH_INT[want.dtype])
    if not bool(differ.any()):
        return None
    ulps = (ulp_order(got) - ulp_order(want)).abs()
    flat = int(ulps.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape))
    return BitDifference(int(differ.sum()), got.numel(), int(ulps.max()), where,
                         got[where].item(), want[where].item())


def bitwise_difference(got: torch.Tensor, want: torch.Tensor, label: str) -> str | None:
    """None when `got` and `want` are the same bits; else one line: how many elements differ,
    the largest difference in ulps of their dtype and where. Integer tensors (token ids) are
    compared by value."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"{label}: {got.dtype} {tuple(got.shape)} where the reference has "
                f"{want.dtype} {tuple(want.shape)}")
    if not got.is_floating_point():
        differ = got != want
        if not bool(differ.any()):
            return None
        first = tuple(int(i) for i in differ.nonzero()[0])
        return (f"{label}: {int(differ.sum())} / {got.numel()} differ, first at {first} "
                f"({got[first].item()} vs {want[first].item()})")
    found = bit_difference(got, want)
    return None if found is None else f"{label}: {found.describe()}"
