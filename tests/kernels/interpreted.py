"""What the interpreter tests of the engine's CUDA kernels share: the process switched to
Triton's interpreter, and a closeness rule relative to the expected tensor's scale."""

from __future__ import annotations

import pytest
import torch

TP_SIZES = (1, 2, 4, 8)


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """Kernels in this process run interpreted (sets TRITON_INTERPRET=1 for the process)."""
    from freetoken.kernels import use_interpreter

    use_interpreter()


def assert_close(got, want, what):
    atol = 1e-5 * max(float(want.abs().max()), 1e-30)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}")
