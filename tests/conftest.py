"""Shared fixtures: the bundled case folders and a CPU-only, single-threaded torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
BUNDLED = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"]


def pytest_configure(config):
    # Two xdist workers on two cores: more intra-op threads only contend.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def golden() -> Path:
    return GOLDEN


def assert_matches_hf(results, ref: dict, label: str, decode_logits: bool = False) -> None:
    """Engine results agree with an HF reference (`verify.cases.hf_reference`): prefill logits
    within rtol=atol=1e-4, greedy ids exactly, and optionally the decode-step logits."""
    for i, result in enumerate(results):
        torch.testing.assert_close(result.prompt_logits, ref[f"prefill_logits_{i}"], rtol=1e-4,
                                   atol=1e-4, msg=lambda m, i=i: f"{label} prompt {i}: {m}")
        assert result.token_ids == ref[f"greedy_ids_{i}"].tolist(), (
            f"{label} prompt {i}: greedy {result.token_ids} != HF "
            f"{ref[f'greedy_ids_{i}'].tolist()}")
        if decode_logits:
            torch.testing.assert_close(result.logits, ref[f"greedy_logits_{i}"], rtol=1e-4,
                                       atol=1e-4,
                                       msg=lambda m, i=i: f"{label} prompt {i} decode: {m}")
