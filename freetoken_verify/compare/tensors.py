"""Tensor comparison records in the shape of a torch.testing.assert_close report, and the one
relative L2 of the harness."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freetoken_verify.compare.tolerances import tolerance_for


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64 on the tensors' device: the relative L2
    every check reports and judges by.

    Zero-norm rule: where `expected` has norm 0 (all zeros, or NaN, whose norm compares with
    nothing), the distance is 0.0 when `actual - expected` has norm 0 too and inf otherwise:
    any error is infinitely large next to nothing. Non-finite values are not special-cased
    otherwise (NaN in `actual` gives NaN, Inf gives inf): a caller that judges the distance
    against a bound tests finiteness first, since `NaN > bound` is False. Equal shapes."""
    a, e = actual.detach().double(), expected.detach().double()
    ref_norm, err_norm = float(e.norm()), float((a - e).norm())
    if ref_norm > 0:
        return err_norm / ref_norm
    return 0.0 if err_norm == 0 else math.inf


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat, rem = divmod(flat, size)
        index.append(rem)
    return tuple(reversed(index))


def _fmt_index(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in index) + ")"


def _fmt_tol(x: float) -> str:
    short = f"{x:.0e}"
    return short if float(short) == x else f"{x:.3e}"


@dataclass
class Comparison:
    """The outcome of comparing one tensor, in the shape of a torch.testing.assert_close report.

    `actual_shape` is set only when the shapes differ; then nothing else was compared.
    """

    name: str
    shape: tuple[int, ...]
    num_mismatched: int
    numel: int
    max_abs: float
    max_abs_index: tuple[int, ...]
    max_rel: float
    max_rel_index: tuple[int, ...]
    rtol: float
    atol: float
    passed: bool
    actual_shape: tuple[int, ...] | None = None

    def message(self) -> str:
        """One line naming the tensor, the mismatch count, the worst errors and the allowance."""
        if self.actual_shape is not None:
            return (f"{self.name}: shape mismatch: actual {self.actual_shape} "
                    f"vs expected {self.shape}")
        count = f"{self.num_mismatched} / {self.numel} mismatched"
        if self.num_mismatched:
            count += f" ({100.0 * self.num_mismatched / self.numel:.1f}%)"
        return (f"{self.name}: {count}; "
                f"worst abs {self.max_abs:.1e} at {_fmt_index(self.max_abs_index)}, "
                f"worst rel {self.max_rel:.1e} at {_fmt_index(self.max_rel_index)}; "
                f"allowed rtol={_fmt_tol(self.rtol)} atol={_fmt_tol(self.atol)}")

    def as_metrics(self) -> dict:
        """The numbers a report records for this comparison."""
        return {"max_abs": self.max_abs, "max_rel": self.max_rel,
                "mismatched": self.num_mismatched, "numel": self.numel}


def _errors(a: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise abs and rel error, with non-finite disagreements as inf.

    Identical infinities count as equal; NaN never does, as with equal_nan=False in torch.testing:
    a NaN in either output is a bug to report, not a value to match.
    """
    nonfinite = ~torch.isfinite(a) | ~torch.isfinite(e)
    abs_err = (a - e).abs()
    abs_err[nonfinite & (a == e)] = 0.0
    abs_err[nonfinite & (a != e)] = math.inf
    rel_err = torch.where(abs_err == 0, 0.0, abs_err / e.abs()).nan_to_num(nan=math.inf)
    return abs_err, rel_err


def worst_element(err: torch.Tensor, shape: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
    """The largest of `err` and its index in `shape` (0.0 at () for an empty tensor)."""
    if err.numel() == 0:
        return 0.0, ()
    flat = int(err.reshape(-1).argmax())
    return float(err.reshape(-1)[flat]), _unravel(flat, shape)


def compare_tensors(name: str, actual: torch.Tensor, expected: torch.Tensor, *,
                    rtol: float | None = None, atol: float | None = None) -> Comparison:
    """Compare `actual` against `expected` elementwise in float64.

    An element mismatches when |a - e| > atol + rtol * |e|, or when a non-finite value is not
    identical on both sides. rtol/atol default to `tolerance_for(expected.dtype)`. A shape
    mismatch gives a failed Comparison rather than an exception, so the report can name it.
    """
    if (rtol is None) != (atol is None):
        raise ValueError("rtol and atol must be given together")
    if rtol is None:
        tol = tolerance_for(expected.dtype)
        rtol, atol = tol.rtol, tol.atol
    shape = tuple(expected.shape)
    if tuple(actual.shape) != shape:
        numel = expected.numel()
        return Comparison(name, shape, numel, numel, math.inf, (), math.inf, (), rtol, atol,
                          passed=False, actual_shape=tuple(actual.shape))
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    abs_err, rel_err = _errors(a, e)
    mismatched = int((abs_err > atol + rtol * e.abs().nan_to_num(posinf=0.0)).sum())
    max_abs, abs_index = worst_element(abs_err, shape)
    max_rel, rel_index = worst_element(rel_err, shape)
    return Comparison(name, shape, mismatched, e.numel(), max_abs, abs_index, max_rel, rel_index,
                      rtol, atol, passed=mismatched == 0)
