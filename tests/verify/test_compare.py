"""Tests for freetoken_verify.compare: tensor comparison records, logit metrics and the greedy
rule."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken_verify.compare import (
    TOLERANCES,
    compare_tensors,
    greedy_check,
    logit_metrics,
    tolerance_for,
)


def _make_tensor(*shape: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (5.0 * torch.randn(*shape, generator=gen)).to(dtype)


def _make_greedy_logits(steps: int, vocab: int, row: int, ranked: list[tuple[int, float]]):
    """Reference logits whose row `row` ranks the given (token, logit) pairs on top."""
    logits = torch.zeros(steps, vocab)
    for token, value in ranked:
        logits[row, token] = value
    return logits


def _assert_mismatch(cmp, count: int, worst_index: tuple[int, ...]):
    assert not cmp.passed, f"passed: {cmp.message()}"
    assert cmp.num_mismatched == count, f"mismatched: {cmp.message()}"
    assert cmp.max_abs_index == worst_index, f"worst abs index: {cmp.message()}"


def test_tolerances_loosen_as_precision_drops():
    """Every tolerance grows from fp32 to fp16 to bf16, matching each dtype's mantissa."""
    fp32, fp16, bf16 = (tolerance_for(d) for d in (torch.float32, torch.float16, torch.bfloat16))
    for field in ("rtol", "atol", "logit_noise"):
        assert getattr(fp32, field) < getattr(fp16, field) < getattr(bf16, field), field
    assert set(TOLERANCES) == {torch.float32, torch.float16, torch.bfloat16}


def test_tolerance_for_unknown_dtype_names_it():
    """An integer dtype has no tolerance, and the error names the dtype."""
    with pytest.raises(ValueError, match="int64"):
        tolerance_for(torch.int64)


def test_identical_tensors_pass_with_zero_error():
    """A tensor compared with a copy of itself passes with no error anywhere."""
    expected = _make_tensor(4, 10)
    cmp = compare_tensors("logits", expected.clone(), expected)
    assert cmp.passed and cmp.num_mismatched == 0 and cmp.numel == 40
    assert cmp.max_abs == 0.0 and cmp.max_rel == 0.0
    assert cmp.message().startswith("logits: 0 / 40 mismatched; worst abs 0.0e+00")


def test_perturbed_elements_are_counted_and_located():
    """Only perturbations beyond atol + rtol*|e| count, and the worst one is located exactly."""
    expected = _make_tensor(4, 10)
    actual = expected.clone()
    actual[2, 7] += 1.0
    actual[1, 3] += 0.5
    actual[0, 0] += 1e-6
    cmp = compare_tensors("hidden", actual, expected)
    _assert_mismatch(cmp, 2, (2, 7))
    assert "2 / 40 mismatched (5.0%)" in cmp.message() and "at (2, 7)" in cmp.message()


def test_message_reports_worst_abs_and_rel_separately():
    """The worst absolute and worst relative errors are reported at their own indices."""
    expected = torch.full((3, 5), 10.0)
    expected[0, 3] = 0.01
    actual = expected.clone()
    actual[2, 1] += 1.0
    actual[0, 3] += 0.05
    cmp = compare_tensors("logits", actual, expected)
    assert cmp.max_rel_index == (0, 3), cmp.message()
    assert cmp.message() == (
        "logits: 2 / 15 mismatched (13.3%); worst abs 1.0e+00 at (2, 1), "
        "worst rel 5.0e+00 at (0, 3); allowed rtol=1e-04 atol=1e-04")


def test_shape_mismatch_is_a_failed_record_naming_both_shapes():
    """Different shapes fail without raising, and the message names both shapes."""
    cmp = compare_tensors("q_proj", torch.zeros(2, 3), torch.zeros(2, 4))
    assert not cmp.passed
    assert "(2, 3)" in cmp.message() and "(2, 4)" in cmp.message()


def test_rtol_without_atol_is_rejected():
    """Giving only one of rtol/atol is a usage error, not a silent default for the other."""
    with pytest.raises(ValueError, match="rtol and atol must be given together"):
        compare_tensors("x", torch.zeros(2), torch.zeros(2), rtol=1e-3)


def test_explicit_tolerance_overrides_dtype_default():
    """An explicit (rtol, atol) replaces the fp32 default in both the verdict and the record."""
    expected = _make_tensor(8)
    actual = expected + 0.01
    assert not compare_tensors("x", actual, expected).passed
    cmp = compare_tensors("x", actual, expected, rtol=0.0, atol=0.02)
    assert cmp.passed and (cmp.rtol, cmp.atol) == (0.0, 0.02), cmp.message()


def test_default_tolerance_follows_expected_dtype():
    """The same 0.01 error passes against a bf16 reference and fails against an fp32 one."""
    expected = _make_tensor(16)
    actual = expected + 0.01
    assert compare_tensors("x", actual.bfloat16(), expected.bfloat16()).passed
    assert not compare_tensors("x", actual, expected).passed


def test_non_finite_values():
    """NaN never matches (not even NaN); identical infinities match; inf vs finite does not."""
    expected = torch.tensor([1.0, math.inf, math.nan, 2.0, -math.inf])
    actual = torch.tensor([math.nan, math.inf, math.nan, math.inf, -math.inf])
    cmp = compare_tensors("x", actual, expected)
    assert cmp.num_mismatched == 3, cmp.message()
    assert cmp.max_abs == math.inf and cmp.max_abs_index == (0,)


def test_as_metrics_keys():
    """A comparison reports max_abs, max_rel, mismatched and numel as plain numbers."""
    expected = _make_tensor(3, 3)
    metrics = compare_tensors("x", expected + 1.0, expected).as_metrics()
    assert set(metrics) == {"max_abs", "max_rel", "mismatched", "numel"}
    assert metrics["mismatched"] == 9 and metrics["numel"] == 9


_values = st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=64)


@settings(max_examples=200, deadline=None)
@given(values=_values, data=st.data())
def test_property_single_perturbation_is_exactly_one_mismatch(values, data):
    """A tensor matches itself; pushing one element past atol + rtol*|e| is exactly 1 mismatch."""
    expected = torch.tensor(values, dtype=torch.float32)
    assert compare_tensors("x", expected.clone(), expected).num_mismatched == 0
    index = data.draw(st.integers(0, len(values) - 1), label="index")
    factor = data.draw(st.floats(2.0, 1e3), label="factor")
    sign = data.draw(st.sampled_from([-1.0, 1.0]), label="sign")
    tol = tolerance_for(torch.float32)
    actual = expected.clone()
    actual[index] += sign * factor * (tol.atol + tol.rtol * abs(values[index]))
    _assert_mismatch(compare_tensors("x", actual, expected), 1, (index,))


def test_logit_metrics_of_identical_logits():
    """Identical logits: zero error, full top-1/top-5 agreement, zero KL."""
    expected = _make_tensor(6, 50)
    m = logit_metrics(expected.clone(), expected)
    assert (m.max_abs, m.rel_l2, m.top1_agree, m.top5_overlap) == (0.0, 0.0, 1.0, 1.0)
    assert m.kl_max == 0.0


def test_logit_metrics_locate_a_flipped_argmax():
    """Changing one row's argmax shows up in top1_agree, and both positions point at it."""
    expected = _make_tensor(6, 50)
    actual = expected.clone()
    actual[4, int(expected[4].argmin())] += 100.0
    m = logit_metrics(actual, expected)
    assert m.top1_agree == pytest.approx(5 / 6)
    assert m.max_abs_position == 4 and m.worst_kl_position == 4
    assert m.kl_max > 1.0 and m.kl_mean == pytest.approx(m.kl_max / 6)


def test_kl_is_reference_to_engine_and_shift_invariant():
    """KL(ref || engine) matches the closed form and ignores a constant shift per row."""
    expected = torch.tensor([[0.0, 0.0]])
    actual = torch.tensor([[math.log(3.0), 0.0]])
    assert logit_metrics(actual, expected).kl_max == pytest.approx(0.5 * math.log(4 / 3))
    shifted = logit_metrics(_make_tensor(3, 20) + 7.0, _make_tensor(3, 20))
    assert shifted.kl_max < 1e-12 and shifted.max_abs == pytest.approx(7.0)


def test_top5_overlap_counts_shared_tokens():
    """Two of the reference's top-5 pushed out by other tokens leaves an overlap of 3/5."""
    expected = torch.arange(10.0).unsqueeze(0)
    actual = expected.clone()
    actual[0, 0] = actual[0, 1] = 100.0
    assert logit_metrics(actual, expected).top5_overlap == pytest.approx(0.6)


def test_logit_metrics_rejects_mismatched_shapes():
    """Logits of different shapes are a usage error that names both shapes."""
    with pytest.raises(ValueError, match=r"\(2, 5\).*\(2, 6\)"):
        logit_metrics(torch.zeros(2, 5), torch.zeros(2, 6))


def test_greedy_identical_continuations_pass():
    """Equal token lists pass with no divergence."""
    result = greedy_check([1, 2, 3], [1, 2, 3], torch.zeros(3, 8), torch.float32)
    assert result.passed and result.diverged_at is None and result.match_len == 3
    assert result.message() == "greedy: 3/3 tokens match"


def test_greedy_near_tie_is_benign_and_stops_comparing():
    """A divergence to the reference's runner-up within the noise passes; later tokens ignored."""
    logits = _make_greedy_logits(6, 10, 3, [(7, 10.0), (2, 9.9)])
    result = greedy_check([1, 1, 1, 2, 5, 5], [1, 1, 1, 7, 4, 4], logits, torch.bfloat16)
    assert result.passed and result.benign, result.message()
    assert result.diverged_at == 3 and result.gap == pytest.approx(0.1, abs=1e-5)


def test_greedy_large_gap_divergence_fails():
    """A divergence where the reference was confident fails, naming step, tokens and gap."""
    logits = _make_greedy_logits(6, 10, 3, [(7, 10.0), (2, 8.0)])
    result = greedy_check([1, 1, 1, 2], [1, 1, 1, 7], logits, torch.bfloat16)
    assert not result.passed and not result.benign
    assert result.message() == ("greedy: step 3: engine token 2, reference 7; the reference "
                                "preferred its token by 2.00e+00 > allowed noise 2.50e-01")


def test_greedy_far_token_fails_even_when_top_two_tie():
    """A near-tie excuses only tokens the reference itself rated within noise of its best: with
    the top two tied, a third token 2.0 below fails; within noise, a third token is benign."""
    logits = _make_greedy_logits(4, 10, 1, [(7, 10.0), (2, 9.99), (5, 8.0)])
    result = greedy_check([1, 5], [1, 7], logits, torch.bfloat16)
    assert not result.passed and "preferred its token by 2.00e+00" in result.message()
    logits = _make_greedy_logits(4, 10, 1, [(7, 10.0), (2, 9.99), (5, 9.98)])
    assert greedy_check([1, 5], [1, 7], logits, torch.bfloat16).passed


def test_greedy_noise_depends_on_dtype():
    """A 0.1 logit gap is a near-tie in bf16 but a real divergence in fp32."""
    logits = _make_greedy_logits(2, 10, 0, [(7, 10.0), (2, 9.9)])
    assert greedy_check([2], [7], logits, torch.bfloat16).passed
    assert not greedy_check([2], [7], logits, torch.float32).passed


def test_greedy_length_mismatch_fails():
    """A continuation that stops early fails even though every compared token agrees."""
    result = greedy_check([1, 2], [1, 2, 3], torch.zeros(3, 8), torch.float32)
    assert not result.passed and result.diverged_at is None
    assert "engine produced 2 tokens, reference 3" in result.message()


def test_greedy_needs_the_divergence_row():
    """Reference logits too short to judge the divergence are a usage error."""
    with pytest.raises(ValueError, match="row 2"):
        greedy_check([1, 1, 2], [1, 1, 3], torch.zeros(2, 8), torch.float32)


def _make_logits(positions: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(positions, vocab, generator=gen, dtype=torch.float64) * 3
    logits[:, 7] += 10.0  # a clear winner at every position, far above any noise
    return logits


def test_judge_logits_bf16_tolerates_scattered_drift_but_not_a_decisive_flip():
    """bf16 judges distributions: drift that leaves elements outside rtol/atol but keeps
    relative L2, KL and top-1 passes; a top-1 flip the reference did not nearly tie fails and
    names the position and both tokens; fp32 stays elementwise."""
    from freetoken_verify.compare import judge_logits

    expected = _make_logits()
    drift = expected.clone()
    drift[:, 20] += 0.3  # outside rtol/atol=5e-2 elementwise, harmless to the distribution
    verdict = judge_logits("logits", drift, expected, torch.bfloat16)
    assert verdict.passed and verdict.comparison.num_mismatched > 0, verdict.message
    assert not judge_logits("logits", drift, expected, torch.float32).passed, \
        "fp32 is elementwise"
    flipped = expected.clone()
    flipped[3, 11] = flipped[3, 7] + 1.0  # engine now prefers token 11 at position 3
    verdict = judge_logits("logits", flipped, expected, torch.bfloat16)
    passed, message = verdict.passed, verdict.message
    assert not passed and "position 3: engine top-1 11, reference 7" in message, message


def test_judge_logits_bf16_fails_on_large_relative_error():
    """Noise well above bf16 precision fails on relative L2 even with top-1 intact."""
    from freetoken_verify.compare import judge_logits

    expected = _make_logits()
    noisy = expected + 0.5 * torch.randn(expected.shape, generator=torch.Generator().manual_seed(1),
                                         dtype=torch.float64)
    verdict = judge_logits("logits", noisy, expected, torch.bfloat16)
    assert not verdict.passed and "relative L2" in verdict.message, verdict.message


def test_nonfinite_engine_logits_say_nan_and_where():
    """Engine logits with NaN / Inf where the reference is finite fail at every dtype with a
    message that says NaN (or Inf) and the first position, not a bare mismatch count."""
    import torch

    from freetoken_verify.compare import judge_logits

    expected = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    actual = expected.clone()
    actual[4, 2], actual[5, 0] = float("nan"), float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        verdict = judge_logits("prompt 2 prefill logits", actual, expected, dtype)
        passed, message = verdict.passed, verdict.message
        assert not passed and message == ("prompt 2 prefill logits: engine logits hold 1 NaN "
                                          "and 1 Inf (of 66), first at position 4"), message


def test_rel_l2_zero_norm_rule():
    """rel_l2 divides by the reference's norm; a zero reference gives 0 against zeros and inf
    against anything else; NaN in the engine's tensor stays NaN for the caller to judge."""
    from freetoken_verify.compare import rel_l2

    assert rel_l2(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])) == \
        pytest.approx(math.sqrt(10) / 5)
    assert rel_l2(torch.zeros(3), torch.zeros(3)) == 0.0
    assert math.isinf(rel_l2(torch.tensor([0.0, 1e-30]), torch.zeros(2)))
    assert math.isnan(rel_l2(torch.tensor([float("nan"), 1.0]), torch.ones(2)))
