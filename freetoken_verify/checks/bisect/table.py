"""bisect's per-module table: one row per module output with its distances to the references
(TP=1 and HF), and the message naming the first row that diverges.

A row compared with TP=1 bit for bit (the bitwise mode) diverges on any differing bit and says
how many elements differ and by how many ulps of the output's dtype; its relative L2 to TP=1
is kept for the table but not judged. Distances to HF are always judged against the row's
bound (the canonical arithmetic is not HF's)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from freetoken_verify.compare import BISECT_FP32_BOUND, BitDifference, bit_difference, rel_l2

LEAVES = ":leaves"


@dataclass
class Row:
    """One module's output compared with the references (None: no such reference)."""

    module: str
    vs_tp1: float | None = None
    vs_hf: float | None = None
    bound: float = BISECT_FP32_BOUND
    ranks_disagree: int | None = None
    shape_vs_tp1: tuple | None = None
    bits_vs_tp1: BitDifference | None = None
    bitwise: bool = False
    """Compared with TP=1 bit for bit: `bits_vs_tp1` judges it, `vs_tp1` is for the table."""
    dtype_vs_tp1: tuple[str, str] | None = None

    @property
    def worst(self) -> float:
        judged = (self.vs_hf,) if self.bitwise else (self.vs_tp1, self.vs_hf)
        return max((v for v in judged if v is not None), default=0.0)

    @property
    def diverged(self) -> bool:
        return (self.ranks_disagree is not None or self.shape_vs_tp1 is not None
                or self.dtype_vs_tp1 is not None or self.bits_vs_tp1 is not None
                or self.worst > self.bound)

    def as_dict(self) -> dict:
        bits = self.bits_vs_tp1
        return {"module": self.module, "vs_tp1": self.vs_tp1, "vs_hf": self.vs_hf,
                "bound": self.bound, "ranks_disagree": self.ranks_disagree,
                "shape_vs_tp1": self.shape_vs_tp1, "bitwise": self.bitwise,
                "bits_differing": None if bits is None else bits.count,
                "max_ulp": None if bits is None else bits.max_ulp}


@dataclass
class Bisection:
    """Every compared module in execution order, and which references were available
    (`TP=1 (bitwise)` where TP=1 was compared bit for bit)."""

    rows: list[Row] = field(default_factory=list)
    references: tuple[str, ...] = ()

    @property
    def first(self) -> Row | None:
        return next((r for r in self.rows if r.diverged), None)

    @property
    def bitwise(self) -> bool:
        return any(r.bitwise for r in self.rows)

    def message(self) -> str:
        row = self.first
        if row is None:
            return ""
        earlier = self.rows[: self.rows.index(row)]
        what = _describe(row) + self._leaves_note(row)
        return f"first divergence: {row.module} ({what}; {_clean(earlier, self.bitwise)})"

    def _leaves_note(self, row: Row) -> str:
        """Where a reduced output differs but its canonical leaves do not: the reduction."""
        leaves = next((r for r in self.rows if r.module == row.module + LEAVES), None)
        if row.bits_vs_tp1 is None or leaves is None or leaves.diverged:
            return ""
        return "; its canonical leaves are bit for bit TP=1's: the reduction differs"


def _clean(earlier: list[Row], bitwise: bool) -> str:
    if not earlier:
        return "the first module"
    worst = max(r.worst for r in earlier)
    if not bitwise:
        return f"earlier modules <= {worst:.1e}"
    if all(r.bitwise for r in earlier):
        hf = any(r.vs_hf is not None for r in earlier)
        return "earlier modules bit for bit TP=1's" + (f", vs HF <= {worst:.1e}" if hf else "")
    # Partial sums (added up by the parent) and HF are judged within the bounds.
    return (f"earlier modules bit for bit TP=1's where compared bit for bit, others <= "
            f"{worst:.1e}")


def _describe(row: Row) -> str:
    if row.ranks_disagree is not None:
        return f"rank {row.ranks_disagree} holds a different replicated tensor than rank 0"
    if row.shape_vs_tp1 is not None:
        return f"shape {row.shape_vs_tp1[0]} where TP=1 has {row.shape_vs_tp1[1]}"
    if row.dtype_vs_tp1 is not None:
        return f"dtype {row.dtype_vs_tp1[0]} where TP=1 has {row.dtype_vs_tp1[1]}"
    parts = []
    if row.bits_vs_tp1 is not None:
        b = row.bits_vs_tp1
        size = f", rel L2 {_fmt(row.vs_tp1)}" if row.vs_tp1 is not None else ""
        parts.append(f"{b.count} / {b.numel} elements differ bit for bit from TP=1{size}, "
                     f"largest {b.max_ulp} ulp at {b.where} ({b.got:.9g} vs {b.want:.9g})")
    over = [(ref, v) for ref, v in (("TP=1", None if row.bitwise else row.vs_tp1),
                                    ("HF", row.vs_hf)) if v is not None and v > row.bound]
    if over:
        parts.append(", ".join(f"rel L2 {_fmt(v)} vs {ref}" for ref, v in over)
                     + f", bound {row.bound:.1e}")
    return "; ".join(parts)


def _fmt(v: float) -> str:
    return "NaN/Inf" if not math.isfinite(v) else f"{v:.2g}"


def compare_with_tp1(row: Row, tensor: torch.Tensor, tp1: torch.Tensor, bitwise: bool) -> None:
    """Fill `row`'s TP=1 columns: shape and dtype first, then relative L2 and, when
    `bitwise`, the bits."""
    if tp1.shape != tensor.shape:
        row.shape_vs_tp1 = (tuple(tensor.shape), tuple(tp1.shape))
        return
    row.vs_tp1 = row_distance(tensor, tp1)
    if not bitwise:
        return
    row.bitwise = True
    if tp1.dtype != tensor.dtype:
        row.dtype_vs_tp1 = (_dtype(tensor), _dtype(tp1))
    elif tensor.is_floating_point():
        row.bits_vs_tp1 = bit_difference(tensor, tp1)
    elif not torch.equal(tensor, tp1):
        differ = tensor != tp1
        where = tuple(int(i) for i in differ.nonzero()[0])
        row.bits_vs_tp1 = BitDifference(int(differ.sum()), tensor.numel(),
                                        int((tensor - tp1).abs().max()), where,
                                        float(tensor[where]), float(tp1[where]))


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def row_distance(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The relative L2 (`compare.rel_l2`) a row records and is judged by, with two rules of
    bisect's own. NaN / Inf in `actual` is inf: a NaN would pass every bound. A reference whose
    norm is below 1e-12 per sqrt(element) (zeros, up to rounding) is measured against that
    floor instead of by rel_l2's zero-norm rule: a module whose output is zero in the reference
    keeps the rounding noise of the engine's output below the bounds instead of inf."""
    if not bool(torch.isfinite(actual).all()):
        return math.inf
    floor = 1e-12 * math.sqrt(expected.numel()) + 1e-30
    ref_norm = float(expected.double().norm())
    if ref_norm >= floor:
        return rel_l2(actual, expected)
    # max() keeps a NaN norm (a reference holding NaN) as NaN, as rel_l2's division would.
    return float((actual.double() - expected.double()).norm()) / max(ref_norm, floor)
