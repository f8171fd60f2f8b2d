"""Requests, their sampling parameters and their results."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SEED_LIMIT = 2**63
"""Seeds lie in [0, SEED_LIMIT): a torch generator takes a signed 64-bit seed on every rank."""
MIN_TEMPERATURE = 1e-5
"""The lowest sampling temperature: float32 logits divided by less overflow to inf and the
sampler's softmax turns them into NaN probabilities (0 is greedy)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick new tokens. `temperature=0` is greedy; `top_k=0` and `top_p=1` disable
    those filters. `return_logits` keeps the logits of every generated step and
    `return_prompt_logits` the logits at every prompt position (float32, on CPU)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    return_logits: bool = False
    return_prompt_logits: bool = False

    def __post_init__(self) -> None:
        _check_sampling(self.max_tokens, self.temperature, self.top_k, self.top_p, self.seed)
        for name in ("ignore_eos", "return_logits", "return_prompt_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def _check_sampling(max_tokens, temperature, top_k, top_p, seed) -> None:
    """SamplingParams' field types and ranges (called from its constructor)."""
    for name, value in (("max_tokens", max_tokens), ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class Request:
    """One prompt handed to an engine: an id unique among the requests in flight, its token
    ids and params, and the seed its sampling starts from (the caller's, else the prompt's
    index in its call, so a request samples the same tokens whatever else is batched)."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    seed: int


def default_seed(params: SamplingParams, index: int) -> int:
    """The seed of the `index`-th prompt of a call: its params' seed, else `index`."""
    return params.seed if params.seed is not None else index


@dataclass
class GenerationResult:
    """One prompt's outcome: new token ids, text when a tokenizer exists, and logits when
    asked for ([new_tokens, vocab] and [prompt_len, vocab])."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    text: str | None = None
    logits: torch.Tensor | None = None
    prompt_logits: torch.Tensor | None = None


@dataclass(eq=False)
class Sequence:
    """A request being generated: its tokens, cache blocks and collected logits. Compared by
    identity: the scheduler's membership tests would otherwise compare every field of every
    running sequence, quadratic in the batch on every step."""

    seq_id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: str | None = None
    step_logits: list[torch.Tensor] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def result(self) -> GenerationResult:
        logits = torch.stack(self.step_logits) if self.params.return_logits else None
        return GenerationResult(list(self.prompt), list(self.output), self.finish_reason or "",
                                logits=logits, prompt_logits=self.prompt_logits)
