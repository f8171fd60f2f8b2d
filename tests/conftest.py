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
