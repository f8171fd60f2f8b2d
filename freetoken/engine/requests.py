"""Requests checked in the parent before they reach any rank: a bad request raised on the
ranks would tear the rank group down, and the next (good) request would find no engine."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from freetoken.engine.sequence import SamplingParams


def token_ids(prompt: Sequence, index: int) -> list[int]:
    """A prompt's token ids as ints; ValueError for floats, strings or bools among them."""
    try:
        ids = [operator.index(t) for t in prompt]
    except TypeError:
        bad = next(t for t in prompt if not _is_index(t))
        raise ValueError(f"prompt {index}: token ids must be integers, got {bad!r}") from None
    if any(isinstance(t, bool) for t in prompt):
        raise ValueError(f"prompt {index}: token ids must be integers, got a bool")
    return ids


def _is_index(value) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_request(ids: list[list[int]], params: list[SamplingParams], vocab_size: int,
                  max_len: int) -> None:
    """Every prompt non-empty, its ids in [0, vocab_size), prompt + max_tokens within
    `max_len`, every params a valid SamplingParams; ValueError naming the prompt otherwise."""
    if not ids:
        raise ValueError("no prompts given")
    if len(params) != len(ids):
        raise ValueError(f"{len(params)} SamplingParams for {len(ids)} prompts")
    for i, (prompt, sp) in enumerate(zip(ids, params)):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"prompt {i}: params must be SamplingParams, got "
                             f"{type(sp).__name__}")
        if not prompt:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:5]} outside the vocabulary "
                             f"[0, {vocab_size})")
        if len(prompt) + sp.max_tokens > max_len:
            raise ValueError(f"prompt {i}: {len(prompt)} tokens + max_tokens={sp.max_tokens} "
                             f"exceed the model length {max_len}")
