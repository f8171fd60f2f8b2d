"""Triton kernels (and the launchers that feed them); each is checked against a torch
reference: the NVFP4 ones by `freetoken-verify --checks kernels`, the engine's CUDA paths by
the tests (tests/kernels, tests/engine).

On a machine without a GPU the kernels run in Triton's interpreter, which `@triton.jit`
selects when the kernel module is imported with TRITON_INTERPRET=1 in the environment. A
process decides once, when its first kernel module is imported (`jit_module`): interpreted
if TRITON_INTERPRET=1 then, compiled otherwise; `use_interpreter()` asks for the
interpreter before that. Launchers import their kernel modules through `jit_module`, at
their first launch, so a process (a test, a verify rank) can still ask after importing
freetoken. Triton itself may already be imported compiled by then (transformers imports
it): the kernel modules therefore call none of triton.language's own @jit functions, only
builtins, their own @jit functions and those of `jit_ops`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os


class KernelModeError(RuntimeError):
    """The interpreter was asked for after this process's kernels were imported compiled."""


def triton_available() -> bool:
    """Whether the triton package is installed. Not imported here: deciding a backend must
    not fix how kernels get compiled (see `use_interpreter`)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """Whether the environment asks for Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def interpreting() -> bool:
    """Whether this process's kernels run in Triton's interpreter: TRITON_INTERPRET as it is
    when first asked (the first kernel module import), fixed for the rest of the process."""
    return interpreter_requested()


def use_interpreter() -> None:
    """Run this process's Triton kernels in the interpreter (CPU). Call it before the first
    kernel launch; a no-op when the process already interprets them. Raises
    `KernelModeError` when kernels were already imported compiled (a process runs one
    kind)."""
    if interpreting.cache_info().currsize and not interpreting():
        raise KernelModeError("freetoken.kernels: this process already imported its Triton "
                              "kernels compiled; set TRITON_INTERPRET=1 before the first "
                              "kernel launch to interpret them")
    os.environ["TRITON_INTERPRET"] = "1"
    interpreting.cache_clear()
    interpreting()


def jit_module(name: str):
    """The kernel module `freetoken.kernels.<name>`, imported on first use: the process's
    kernel mode (`interpreting`) is fixed first, so that its @triton.jit functions and those
    of `jit_ops` are all interpreted or all compiled (TRITON_INTERPRET, which @triton.jit
    reads as it decorates, is set again should something have cleared it since)."""
    if interpreting():
        os.environ["TRITON_INTERPRET"] = "1"
    return importlib.import_module(f"freetoken.kernels.{name}")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block shapes are powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())
