"""Token selection: greedy, or temperature with top-k / top-p filtering."""

from __future__ import annotations

import torch

from freetoken.engine.sequence import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row of logits [vocab]."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k:
        # By index, not by value: ties with the k-th score must not widen the set.
        top = torch.topk(scores, min(params.top_k, scores.numel())).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(0, top, True)
        scores = scores.masked_fill(~keep, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_scores, dim=-1) >= params.top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(scores, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))
