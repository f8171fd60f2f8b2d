"""Logit metrics, golden's judgement of engine logits against a reference, and the greedy
near-tie rule."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from freetoken_verify.compare.tensors import (
    Comparison,
    compare_tensors,
    rel_l2,
    worst_element,
)
from freetoken_verify.compare.tolerances import Tolerance, tolerance_for


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
    max_abs, (position, _) = worst_element((a - e).abs(), tuple(e.shape))
    kl = _kl_rows(a, e)
    top1_agree = float((a.argmax(dim=1) == e.argmax(dim=1)).double().mean())
    top5_overlap = _topk_overlap(a, e, min(5, e.shape[1]))
    return LogitMetrics(max_abs, position, rel_l2(a, e), top1_agree, top5_overlap,
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


@dataclass(frozen=True)
class TopOneFlip:
    """A position whose engine top-1 token differs from the reference's, which preferred its
    own token by `margin`."""

    position: int
    engine_token: int
    reference_token: int
    margin: float

    def describe(self, noise: float) -> str:
        return (f"position {self.position}: engine top-1 {self.engine_token}, reference "
                f"{self.reference_token} preferred by {self.margin:.2e} > noise {noise:.2e}")


def _decisive_top1_flip(a: torch.Tensor, e: torch.Tensor, noise: float) -> TopOneFlip | None:
    """The first position whose top-1 differs while the reference preferred its own token by
    more than `noise`, or None."""
    a_top, e_top = a.argmax(dim=1), e.argmax(dim=1)
    margin = e.gather(1, e_top[:, None])[:, 0] - e.gather(1, a_top[:, None])[:, 0]
    bad = ((a_top != e_top) & (margin > noise)).nonzero().flatten()
    if not len(bad):
        return None
    p = int(bad[0])
    return TopOneFlip(p, int(a_top[p]), int(e_top[p]), float(margin[p]))


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


@dataclass(frozen=True)
class Verdict:
    """A judgement of one tensor against its reference: whether it `passed`, the one-line
    `message` a report row carries, and the elementwise `comparison` it was based on."""

    passed: bool
    message: str
    comparison: Comparison


def judge_logits(name: str, actual: torch.Tensor, expected: torch.Tensor,
                 dtype: torch.dtype, baseline: LogitMetrics | None = None) -> Verdict:
    """Pass/fail for engine logits [P, V] against reference logits under `dtype`'s tolerance:
    elementwise for fp32, as distributions for bf16 / fp16 (see `Tolerance`,
    `effective_tolerance`)."""
    tol = effective_tolerance(dtype, baseline)
    cmp = compare_tensors(name, actual, expected, rtol=tol.rtol, atol=tol.atol)
    nonfinite = nonfinite_message(name, actual, expected)
    if nonfinite is not None:
        return Verdict(False, nonfinite, cmp)
    if tol.max_rel_l2 is None or actual.shape != expected.shape:
        return Verdict(cmp.passed, cmp.message(), cmp)
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
        problems.append(flip.describe(tol.logit_noise))
    summary = (f"{cmp.num_mismatched} / {cmp.numel} elements outside rtol={tol.rtol:.0e} "
               f"atol={tol.atol:.0e}, worst abs {cmp.max_abs:.1e}")
    if problems:
        return Verdict(False, f"{name}: {'; '.join(problems)} ({summary})", cmp)
    return Verdict(True, f"{name}: distribution within tolerance ({summary})", cmp)
