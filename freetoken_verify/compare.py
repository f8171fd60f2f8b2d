"""Tensor comparison records, logit metrics and the greedy-continuation rule.

Every check that compares the engine against a reference goes through here, so a failure always
reads the same way: how many elements mismatched, where the worst one is, and what was allowed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

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
    """Return the tolerance for `dtype`; ValueError for a dtype with no entry."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in TOLERANCES)
        raise ValueError(f"no tolerance for dtype {dtype}; known dtypes: {known}") from None


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


def _worst(err: torch.Tensor, shape: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
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
    max_abs, abs_index = _worst(abs_err, shape)
    max_rel, rel_index = _worst(rel_err, shape)
    return Comparison(name, shape, mismatched, e.numel(), max_abs, abs_index, max_rel, rel_index,
                      rtol, atol, passed=mismatched == 0)


@dataclass
class LogitMetrics:
    """How far the engine's logits are from the reference's, per position and overall."""

    max_abs: float
    max_abs_position: int
    rel_l2: float
    top1_agree: float
    top5_overlap: float
    kl_mean: float
    kl_max: float
    worst_kl_position: int

    def as_dict(self) -> dict:
        """Plain Python numbers, ready for a report."""
        return {k: int(v) if k.endswith("position") else float(v)
                for k, v in asdict(self).items()}


def _topk_overlap(a: torch.Tensor, e: torch.Tensor, k: int) -> float:
    in_a = torch.zeros_like(a, dtype=torch.bool).scatter_(1, a.topk(k, dim=1).indices, True)
    in_e = torch.zeros_like(e, dtype=torch.bool).scatter_(1, e.topk(k, dim=1).indices, True)
    return float((in_a & in_e).sum(dim=1).double().mean() / k)


def _kl_rows(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """KL(reference || engine) per row: how surprised sampling from the reference would be."""
    log_p = torch.log_softmax(e, dim=1)
    log_q = torch.log_softmax(a, dim=1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), 0.0)
    # Rounding can leave identical rows at -1e-17; KL is never negative.
    return terms.sum(dim=1).clamp_min(0.0)


def logit_metrics(actual: torch.Tensor, expected: torch.Tensor) -> LogitMetrics:
    """Summarise engine logits `actual` [P, V] against reference logits `expected` [P, V]."""
    if actual.shape != expected.shape or expected.dim() != 2 or expected.shape[0] == 0:
        raise ValueError(f"logit_metrics needs two equal [positions, vocab] tensors, got actual "
                         f"{tuple(actual.shape)} and expected {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    max_abs, (position, _) = _worst((a - e).abs(), tuple(e.shape))
    ref_norm, err_norm = float(e.norm()), float((a - e).norm())
    rel_l2 = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
    kl = _kl_rows(a, e)
    top1_agree = float((a.argmax(dim=1) == e.argmax(dim=1)).double().mean())
    top5_overlap = _topk_overlap(a, e, min(5, e.shape[1]))
    return LogitMetrics(max_abs, position, rel_l2, top1_agree, top5_overlap,
                        float(kl.mean()), float(kl.max()), int(kl.argmax()))


@dataclass
class GreedyResult:
    """Whether the engine's greedy continuation matches the reference's, and if not, why."""

    match_len: int
    diverged_at: int | None
    benign: bool
    gap: float | None
    noise: float
    passed: bool
    actual_len: int
    expected_len: int
    actual_token: int | None = None
    expected_token: int | None = None

    def message(self) -> str:
        """One line: the agreement, or the step, the tokens and the gap against the noise."""
        if self.diverged_at is None:
            if self.passed:
                return f"greedy: {self.match_len}/{self.expected_len} tokens match"
            return (f"greedy: engine produced {self.actual_len} tokens, reference "
                    f"{self.expected_len}; the first {self.match_len} agree")
        head = (f"greedy: step {self.diverged_at}: engine token {self.actual_token}, "
                f"reference {self.expected_token}")
        if self.benign:
            return (f"{head}; benign near-tie (the reference rated the engine's token "
                    f"{self.gap:.2e} below its best, within noise {self.noise:.2e}); later "
                    "tokens not compared")
        return (f"{head}; the reference preferred its token by {self.gap:.2e} > allowed noise "
                f"{self.noise:.2e}")

    def as_metrics(self) -> dict:
        """The numbers a report records; `greedy_match`/`greedy_total` render as `16/16`."""
        metrics = {"greedy_match": self.match_len, "greedy_total": self.expected_len}
        if self.gap is not None:
            metrics["greedy_gap"] = self.gap
        return metrics


def _common_prefix(a: list[int], b: list[int]) -> int:
    # strict=False: the lists may differ in length; the shorter one bounds the prefix.
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def greedy_check(actual_ids: list[int], expected_ids: list[int],
                 expected_logits: torch.Tensor, dtype: torch.dtype,
                 noise: float | None = None) -> GreedyResult:
    """Judge a greedy continuation against the reference's.

    At the first differing step, a divergence is benign when the reference itself rated the
    engine's token within the logit noise of its own choice (a near-tie); `gap` is that margin.
    Tokens after a divergence are not compared: the two contexts differ from there on.
    `expected_logits[i]` is the reference's logit row that chose `expected_ids[i]`.
    """
    actual_ids, expected_ids = [int(t) for t in actual_ids], [int(t) for t in expected_ids]
    noise = tolerance_for(dtype).logit_noise if noise is None else noise
    n = _common_prefix(actual_ids, expected_ids)
    lengths = {"actual_len": len(actual_ids), "expected_len": len(expected_ids)}
    if n == min(len(actual_ids), len(expected_ids)):
        same_len = len(actual_ids) == len(expected_ids)
        return GreedyResult(n, None, False, None, noise, passed=same_len, **lengths)
    if expected_logits.shape[0] <= n:
        raise ValueError(f"greedy divergence at step {n} needs reference logits row {n}, "
                         f"but expected_logits has {expected_logits.shape[0]} rows")
    row = expected_logits[n].detach().to("cpu", torch.float64)
    gap = float(row.max() - row[actual_ids[n]])
    benign = gap <= noise
    return GreedyResult(n, n, benign, gap, noise, passed=benign, actual_token=actual_ids[n],
                        expected_token=expected_ids[n], **lengths)


def _decisive_top1_flip(a: torch.Tensor, e: torch.Tensor, noise: float):
    """The first position whose top-1 differs while the reference preferred its own token by
    more than `noise`: (position, engine token, reference token, margin), or None."""
    a_top, e_top = a.argmax(dim=1), e.argmax(dim=1)
    margin = e.gather(1, e_top[:, None])[:, 0] - e.gather(1, a_top[:, None])[:, 0]
    bad = ((a_top != e_top) & (margin > noise)).nonzero().flatten()
    if not len(bad):
        return None
    p = int(bad[0])
    return p, int(a_top[p]), int(e_top[p]), float(margin[p])


def effective_tolerance(dtype: torch.dtype, baseline: LogitMetrics | None = None) -> Tolerance:
    """`dtype`'s tolerance, widened for low precision by the reference's own noise: the
    engine's logits may be twice as far from the fp32 reference as HF's own run at this dtype
    (relative L2; KL, being quadratic in the logit error, four times), and a near-tie is
    anything within that run's largest logit deviation."""
    tol = tolerance_for(dtype)
    if baseline is None or tol.max_rel_l2 is None:
        return tol
    return Tolerance(tol.rtol, tol.atol, max(tol.logit_noise, baseline.max_abs),
                     max(tol.max_rel_l2, 2 * baseline.rel_l2),
                     max(tol.max_kl, 4 * baseline.kl_mean))


def nonfinite_message(name: str, actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """`name: engine logits hold NaN ...` naming the first position, when the engine gives
    NaN or Inf where the reference is finite; None otherwise. Said first, because every other
    metric of such logits is NaN too and names no cause."""
    if actual.shape != expected.shape:
        return None
    bad = ~torch.isfinite(actual) & torch.isfinite(expected)
    if not bool(bad.any()):
        return None
    values = actual[bad]
    kinds = " and ".join(f"{n} {label}" for label, n in (("NaN", int(values.isnan().sum())),
                                                          ("Inf", int(values.isinf().sum())))
                         if n)
    position = int(bad.reshape(bad.shape[0], -1).any(dim=-1).nonzero()[0]) if bad.dim() else 0
    return (f"{name}: engine logits hold {kinds} (of {actual.numel()}), first at position "
            f"{position}")


def judge_logits(name: str, actual: torch.Tensor, expected: torch.Tensor,
                 dtype: torch.dtype, baseline: LogitMetrics | None = None,
                 ) -> tuple[bool, str, Comparison]:
    """Pass/fail for engine logits [P, V] against reference logits under `dtype`'s tolerance:
    elementwise for fp32, as distributions for bf16 / fp16 (see `Tolerance`,
    `effective_tolerance`)."""
    tol = effective_tolerance(dtype, baseline)
    cmp = compare_tensors(name, actual, expected, rtol=tol.rtol, atol=tol.atol)
    nonfinite = nonfinite_message(name, actual, expected)
    if nonfinite is not None:
        return False, nonfinite, cmp
    if tol.max_rel_l2 is None or actual.shape != expected.shape:
        return cmp.passed, cmp.message(), cmp
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    m = logit_metrics(a, e)
    problems = []
    if m.rel_l2 > tol.max_rel_l2:
        problems.append(f"relative L2 {m.rel_l2:.2e} > allowed {tol.max_rel_l2:.1e}")
    if tol.max_kl is not None and m.kl_mean > tol.max_kl:
        problems.append(f"KL mean {m.kl_mean:.2e} (max {m.kl_max:.2e} at position "
                        f"{m.worst_kl_position}) > allowed {tol.max_kl:.1e}")
    flip = _decisive_top1_flip(a, e, tol.logit_noise)
    if flip is not None:
        problems.append(f"position {flip[0]}: engine top-1 {flip[1]}, reference {flip[2]} "
                        f"preferred by {flip[3]:.2e} > noise {tol.logit_noise:.2e}")
    summary = (f"{cmp.num_mismatched} / {cmp.numel} elements outside rtol={tol.rtol:.0e} "
               f"atol={tol.atol:.0e}, worst abs {cmp.max_abs:.1e}")
    if problems:
        return False, f"{name}: {'; '.join(problems)} ({summary})", cmp
    return True, f"{name}: distribution within tolerance ({summary})", cmp


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
