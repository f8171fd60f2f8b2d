"""Which implementation serves an NVFP4 layer: `triton` (the W4A16 kernels) or `torch` (the
reference: dequantize the experts hit, then matmul in float32).

Default: triton on CUDA whenever it can serve the configuration; torch on CPU, where the
kernels would only run in Triton's (slow) interpreter, which is for tests. Every refusal
carries a reason a person can act on.

The choice is made once per process for each (device, dtype, sizes, request, interpreter
switch): layers ask on every forward, and deciding afresh (a module lookup for triton, the
device's capability) cost about 30 us per layer per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from freetoken.formats.nvfp4.format import GROUP
from freetoken.kernels import interpreter_requested, triton_available

TRITON, TORCH = "triton", "torch"
BACKENDS = ("auto", TRITON, TORCH)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class BackendError(ValueError):
    """A requested backend cannot serve a configuration; the message says why."""


@dataclass(frozen=True)
class BackendChoice:
    """The chosen backend and why (including why the other one was not taken)."""

    name: str
    reason: str


@functools.cache
def _triton_installed() -> bool:
    """Whether triton is installed, looked up once per process."""
    return triton_available()


def _shape_reason(hidden: int, local_intermediate: int | None) -> str | None:
    for what, size in (("hidden size", hidden), ("TP-local intermediate size",
                                                 local_intermediate)):
        if size is not None and size % GROUP:
            return f"{what} {size} is not a multiple of the {GROUP}-element NVFP4 group"
    return None


def triton_unavailable_reason(device, dtype: torch.dtype, hidden: int,
                              local_intermediate: int | None = None) -> str | None:
    """Why the triton backend cannot serve this configuration, or None when it can."""
    device = torch.device(device)
    if not _triton_installed():
        return "the triton package is not installed"
    if dtype not in _DTYPES:
        return f"activations of dtype {dtype} (supported: bfloat16, float16, float32)"
    shape = _shape_reason(hidden, local_intermediate)
    if shape:
        return shape
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"compute capability {major}.{minor}: the kernels need 8.0 or newer"
        return None
    if device.type != "cpu":
        return f"device type {device.type!r} has no Triton backend"
    if not interpreter_requested():
        return ("on CPU, Triton kernels run only in its interpreter: set TRITON_INTERPRET=1 "
                "before the kernels are first used (freetoken.kernels.use_interpreter())")
    if dtype != torch.float32:
        return (f"the Triton interpreter computes {dtype} arithmetic wrongly; on CPU the "
                "kernels need float32 activations")
    return None


def choose_backend(device, dtype: torch.dtype, hidden: int,
                   local_intermediate: int | None = None, requested: str = "auto"
                   ) -> BackendChoice:
    """Pick the backend for a layer; BackendError when `requested` cannot serve it. Decided
    once per process for each configuration (see the module docstring)."""
    return _choose(torch.device(device), dtype, hidden, local_intermediate, requested,
                   interpreter_requested())


@functools.lru_cache(maxsize=256)
def _choose(device: torch.device, dtype: torch.dtype, hidden: int,
            local_intermediate: int | None, requested: str, interpreted: bool) -> BackendChoice:
    """`choose_backend`'s decision; `interpreted` (TRITON_INTERPRET=1) is part of the key
    because the CPU answer depends on it."""
    if requested not in BACKENDS:
        raise BackendError(f"NVFP4 backend must be one of {', '.join(BACKENDS)}, "
                           f"got {requested!r}")
    if requested == TORCH:
        return BackendChoice(TORCH, "requested")
    why_not = triton_unavailable_reason(device, dtype, hidden, local_intermediate)
    if requested == TRITON:
        if why_not:
            raise BackendError(f"the triton NVFP4 backend cannot serve {dtype} on "
                               f"{torch.device(device)} (hidden={hidden}, local "
                               f"intermediate={local_intermediate}): {why_not}")
        return BackendChoice(TRITON, "requested")
    if torch.device(device).type != "cuda":
        return BackendChoice(TORCH, "CPU default: the torch reference (Triton would run in "
                                    "its interpreter, which is for tests)")
    if why_not:
        return BackendChoice(TORCH, f"triton cannot serve this configuration: {why_not}")
    return BackendChoice(TRITON, "CUDA default")
