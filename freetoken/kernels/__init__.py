"""Triton kernels (and the launchers that feed them); each is checked against a torch
reference: the NVFP4 ones by `freetoken-verify --checks kernels`, the engine's CUDA paths by
the tests (tests/kernels, tests/engine).

On a machine without a GPU the kernels run in Triton's interpreter, which `@triton.jit`
selects when the kernel module is IMPORTED with TRITON_INTERPRET=1 in the environment. The
launchers import their kernel modules lazily, so a process (a test, a verify rank) can still
switch with `use_interpreter()` before the first launch. The kernel modules use only Triton
builtins, their own @jit functions and those of `jit_ops` (reloaded first), so it does not
matter whether triton itself was imported before the switch (transformers imports it, for
one).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

# jit_ops first: the kernel modules reloaded after it see its interpreted functions.
JIT_MODULES = ("freetoken.kernels.jit_ops", "freetoken.kernels.nvfp4_jit",
               "freetoken.kernels.nvfp4_mma", "freetoken.kernels.moe_jit",
               "freetoken.kernels.attention_jit", "freetoken.kernels.norm_rope_jit",
               "freetoken.kernels.delta_rule_jit")


def triton_available() -> bool:
    """Whether the triton package is installed. Not imported here: deciding a backend must
    not fix how kernels get compiled (see `use_interpreter`)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """Whether this process asked for Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreted(module) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    kernels = [v for k, v in vars(module).items() if not k.startswith("__")]
    jitted = [k for k in kernels if type(k).__name__ in ("JITFunction", "InterpretedFunction")]
    return all(isinstance(k, InterpretedFunction) for k in jitted)


def use_interpreter() -> None:
    """Run this process's Triton kernels in the interpreter (CPU). Kernel modules imported
    before, as compiled kernels, are re-imported so that their kernels become interpreted;
    launchers look kernels up through the module, so they see the new ones."""
    os.environ["TRITON_INTERPRET"] = "1"
    for name in JIT_MODULES:
        module = sys.modules.get(name)
        if module is not None and not _interpreted(module):
            importlib.reload(module)
