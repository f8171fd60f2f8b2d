"""Tests for freetoken.engine.sampler.sample and SamplingParams validation."""

import math
from collections import Counter

import pytest
import torch

from freetoken.engine.sampler import sample
from freetoken.engine.sequence import SamplingParams

_PROBS = [0.5, 0.3, 0.15, 0.05]


def _make_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def _make_random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return 3.0 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def _make_generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> Counter:
    gen = _make_generator(seed)
    return Counter(sample(logits, params, gen) for _ in range(n))


def _assert_frequencies(counts: Counter, expected: list[float], n: int, tol: float) -> None:
    for token, want in enumerate(expected):
        got = counts[token] / n
        assert abs(got - want) <= tol, f"token {token}: frequency {got:.3f}, expected {want:.3f}"


def test_temperature_zero_is_argmax():
    """temperature=0 returns the argmax of every row, without a generator."""
    logits = _make_random_logits(20, 50, seed=1)
    for row in range(logits.shape[0]):
        got = sample(logits[row], SamplingParams(temperature=0.0), None)
        assert got == int(logits[row].argmax()), f"row {row}: {got}"


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_top_k_one_is_argmax_at_any_temperature(temperature):
    """top_k=1 keeps only the best token, so sampling at any temperature returns the argmax."""
    logits = _make_random_logits(20, 50, seed=2)
    params = SamplingParams(temperature=temperature, top_k=1)
    gen = _make_generator()
    for row in range(logits.shape[0]):
        got = sample(logits[row], params, gen)
        assert got == int(logits[row].argmax()), f"row {row} at T={temperature}: {got}"


def test_fixed_seed_is_reproducible():
    """Two generators with the same seed give the same draws; another seed gives others."""
    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0)
    draws = [[sample(logits, params, g) for _ in range(30)]
             for g in (_make_generator(7), _make_generator(7), _make_generator(8))]
    assert draws[0] == draws[1], f"same seed differs: {draws[0]} vs {draws[1]}"
    assert draws[0] != draws[2], f"different seeds agree: {draws[0]}"


def test_top_p_keeps_only_the_nucleus():
    """top_p=0.7 over probs [.5, .3, .15, .05] keeps tokens 0 and 1 (renormalised);
    top_p=0.85 admits token 2 but never token 3."""
    n = 3000
    logits = _make_logits(_PROBS)
    narrow = _draw(logits, SamplingParams(temperature=1.0, top_p=0.7), n)
    assert set(narrow) == {0, 1}, f"top_p=0.7 sampled {dict(narrow)}"
    _assert_frequencies(narrow, [0.5 / 0.8, 0.3 / 0.8], n, tol=0.04)
    wide = _draw(logits, SamplingParams(temperature=1.0, top_p=0.85), n)
    assert set(wide) == {0, 1, 2}, f"top_p=0.85 sampled {dict(wide)}"
    _assert_frequencies(wide, [p / 0.95 for p in _PROBS[:3]], n, tol=0.04)


def test_top_k_two_stays_in_the_top_two():
    """top_k=2 samples only the two most likely tokens, both of them, renormalised."""
    n = 3000
    logits = _make_logits([0.15, 0.5, 0.05, 0.3])
    counts = _draw(logits, SamplingParams(temperature=1.0, top_k=2), n)
    assert set(counts) == {1, 3}, f"top_k=2 sampled {dict(counts)}"
    _assert_frequencies(counts, [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8], n, tol=0.04)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_frequencies_match_tempered_softmax(temperature):
    """Without filters, draw frequencies match softmax(logits / temperature)."""
    n = 4000
    logits = _make_logits(_PROBS)
    counts = _draw(logits, SamplingParams(temperature=temperature), n)
    expected = torch.softmax(logits / temperature, dim=-1).tolist()
    _assert_frequencies(counts, expected, n, tol=0.03)


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens must be >= 1"),
    ("temperature", -0.1, "temperature must be >= 0"),
    ("top_p", 0.0, "top_p must be in"),
    ("top_p", 1.01, "top_p must be in"),
    ("top_k", -1, "top_k must be >= 0"),
])
def test_invalid_sampling_params_are_rejected(field, value, message):
    """Out-of-range sampling parameters raise ValueError naming the field."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_boundary_sampling_params_are_accepted():
    """The documented 'off' values (temperature 0, top_k 0, top_p 1) and max_tokens 1 are valid."""
    params = SamplingParams(max_tokens=1, temperature=0.0, top_k=0, top_p=1.0)
    assert (params.max_tokens, params.top_k, params.top_p) == (1, 0, 1.0), f"{params}"


def test_top_k_does_not_widen_on_ties():
    """top_k keeps exactly k tokens even when others tie with the k-th score: with two tied
    maxima and top_k=1 only one token is ever drawn."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0])
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_k=1), gen) for _ in range(200)}
    assert len(drawn) == 1 and drawn <= {1, 2}, f"top_k=1 drew {drawn}"
