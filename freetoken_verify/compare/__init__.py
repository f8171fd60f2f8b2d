"""Tensor comparison records, the one relative L2, logit metrics, the greedy-continuation rule
and every tolerance the checks judge by.

Every check that compares the engine against a reference goes through here, so a failure always
reads the same way: how many elements mismatched, where the worst one is, and what was allowed.
`tolerances` holds the allowances (by check, then by dtype), `tensors` the elementwise
comparison and `rel_l2`, `logits` golden's judgement of logits, `bits` bit-for-bit differences.
"""

from freetoken_verify.compare.bits import (
    BitDifference,
    bit_difference,
    bitwise_difference,
    ulp_order,
)
from freetoken_verify.compare.logits import (
    GreedyResult,
    LogitMetrics,
    TopOneFlip,
    Verdict,
    effective_tolerance,
    greedy_check,
    judge_logits,
    logit_metrics,
    nonfinite_message,
)
from freetoken_verify.compare.tensors import Comparison, compare_tensors, rel_l2, worst_element
from freetoken_verify.compare.tolerances import (
    BISECT_FP32_BOUND,
    BISECT_LOW_FACTOR,
    BISECT_LOW_FLOOR,
    KERNEL_MIN_WITHIN,
    KERNEL_TOLERANCES,
    TOLERANCES,
    KernelTolerance,
    Tolerance,
    tolerance_for,
)

__all__ = ["BISECT_FP32_BOUND", "BISECT_LOW_FACTOR", "BISECT_LOW_FLOOR", "KERNEL_MIN_WITHIN",
           "KERNEL_TOLERANCES", "TOLERANCES", "BitDifference", "Comparison", "GreedyResult",
           "KernelTolerance", "LogitMetrics", "Tolerance", "TopOneFlip", "Verdict",
           "bit_difference", "bitwise_difference", "compare_tensors", "effective_tolerance",
           "greedy_check", "judge_logits", "logit_metrics", "nonfinite_message", "rel_l2",
           "tolerance_for", "ulp_order", "worst_element"]
