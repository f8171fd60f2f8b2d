"""Requests checked in the parent before they reach any rank: a bad request raised on the
ranks would tear the rank group down, and the next (good) request would find no engine."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from freetoken.engine.sequence import SamplingParams


@dataclass(frozen=True)
class Limits:
    """What one engine can take: token ids below `vocab_size`, `max_len` tokens per request
    (prompt + new), and `num_blocks` cache blocks of `block_size` tokens in all."""

    vocab_size: int
    max_len: int
    num_blocks: int
    block_size: int


def split_prompts(prompts) -> list:
    """`generate`'s first argument as a list of prompts: one string, one id list or one 1-D
    tensor is a single prompt; a 2-D tensor is one prompt per row; a list or tuple holds
    prompts. ValueError naming what it got otherwise."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [prompts]
        if prompts.dim() == 2:
            return list(prompts)
        raise ValueError(f"prompts: a tensor of token ids must be 1-D (one prompt) or 2-D "
                         f"(one prompt per row), got shape {list(prompts.shape)}")
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts: a string, a list of token ids, a tensor or a list of "
                         f"those, got {type(prompts).__name__}")
    if prompts and _is_index(prompts[0]):
        return [prompts]
    return list(prompts)


def token_ids(prompt, index: int) -> list[int]:
    """A prompt's token ids as ints, from a list, a tuple or a 1-D integer tensor;
    ValueError naming the prompt for floats, strings or bools among them."""
    if isinstance(prompt, torch.Tensor):
        return _tensor_ids(prompt, index)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt {index}: a string, a list of token ids or a 1-D tensor, got "
                         f"{type(prompt).__name__}")
    try:
        ids = [operator.index(t) for t in prompt]
    except TypeError:
        bad = next(t for t in prompt if not _is_index(t))
        raise ValueError(f"prompt {index}: token ids must be integers, got {bad!r}") from None
    if any(isinstance(t, bool) for t in prompt):
        raise ValueError(f"prompt {index}: token ids must be integers, got a bool")
    return ids


def _tensor_ids(prompt: torch.Tensor, index: int) -> list[int]:
    if prompt.dim() != 1:
        raise ValueError(f"prompt {index}: a tensor of token ids must be 1-D, got shape "
                         f"{list(prompt.shape)}")
    if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
        raise ValueError(f"prompt {index}: a tensor of token ids must have an integer dtype, "
                         f"got {prompt.dtype}")
    return prompt.tolist()


def _is_index(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_prompt_ids(prompt: list[int], index: int, vocab_size: int) -> None:
    """ValueError naming prompt `index` when it is empty or holds ids outside the vocabulary."""
    if not prompt:
        raise ValueError(f"prompt {index} is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt {index}: token ids {bad[:5]} outside the vocabulary "
                         f"[0, {vocab_size})")


def check_request(ids: list[list[int]], params: list[SamplingParams], limits: Limits) -> None:
    """Every prompt non-empty, its ids in the vocabulary, prompt + max_tokens within the model
    length and the whole cache, every params a valid SamplingParams; ValueError naming the
    prompt otherwise."""
    if not ids:
        raise ValueError("no prompts given")
    if len(params) != len(ids):
        raise ValueError(f"{len(params)} SamplingParams for {len(ids)} prompts")
    for i, (prompt, sp) in enumerate(zip(ids, params)):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"prompt {i}: params must be SamplingParams, got "
                             f"{type(sp).__name__}")
        check_prompt_ids(prompt, i, limits.vocab_size)
        if len(prompt) + sp.max_tokens > limits.max_len:
            raise ValueError(f"prompt {i}: {len(prompt)} tokens + max_tokens={sp.max_tokens} "
                             f"exceed the model length {limits.max_len}")
        needed = -(-(len(prompt) + sp.max_tokens) // limits.block_size)
        if needed > limits.num_blocks:
            raise ValueError(f"prompt {i}: {len(prompt)} tokens + max_tokens={sp.max_tokens} "
                             f"need {needed} cache blocks, the cache has {limits.num_blocks} "
                             f"(num_kv_blocks)")
