"""What the quantized-format model tests share: the engine's outputs on a checkpoint folder
and the comparison with the same prompts on its dequantized twin."""

from __future__ import annotations

from pathlib import Path

import torch

from freetoken import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]


def generate(folder: Path, tp: int) -> list:
    """Three greedy tokens per prompt of `PROMPTS`, with prompt and step logits, in float32."""
    params = SamplingParams(max_tokens=3, ignore_eos=True, return_logits=True,
                            return_prompt_logits=True)
    with LLM(folder, tp=tp, device="cpu", dtype="float32", progress=False) as llm:
        return llm.generate(PROMPTS, params)


def assert_same_outputs(got: list, want: list, label: str, atol: float = 1e-5) -> None:
    """Equal tokens; prompt and step logits within rtol 1e-5 and `atol`."""
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.token_ids == b.token_ids, f"{label} prompt {i}: {a.token_ids} != {b.token_ids}"
        for what in ("prompt_logits", "logits"):
            torch.testing.assert_close(getattr(a, what), getattr(b, what), rtol=1e-5,
                                       atol=atol,
                                       msg=lambda m, w=what, i=i: f"{label} {i} {w}: {m}")
