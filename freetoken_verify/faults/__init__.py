"""Canonical TP bugs, injectable into the engine with `freetoken-verify --fault NAME`.

Each fault monkeypatches the engine inside the process that calls it (every rank, before
the checks run). They exist to show that the checks catch the bugs they are meant for: a
harness that stays green with a fault injected is broken. Each registers itself beside its
function, with its catalogue entries (`@fault` of `freetoken_verify/faults/registry.py`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from freetoken_verify.faults.nvfp4 import NVFP4_MOE_KERNEL_FAULTS
from freetoken_verify.faults.registry import REGISTERED, Fault

MODULES = ("sharding", "memory", "nvfp4", "collectives", "port_mistakes", "layout", "backend",
           "scales", "kernels", "quant_kernels", "quant_config", "graphs", "invariant", "where")
"""The fault modules, in the order `--list`, the catalogue and the docs show their faults
(each module's in the order it defines them)."""


def _in_order() -> tuple[Fault, ...]:
    """Every registered fault, module by module in `MODULES` order; a fault registered from a
    module missing there is refused (it would not be imported on a rank)."""
    for module in MODULES:
        importlib.import_module(f"{__name__}.{module}")
    place = {f"{__name__}.{module}": i for i, module in enumerate(MODULES)}
    stray = [f.name for f in REGISTERED.values() if f.apply.__module__ not in place]
    if stray:
        raise ValueError(f"faults {stray} are registered from modules missing in MODULES "
                         "(freetoken_verify/faults/__init__.py)")
    return tuple(sorted(REGISTERED.values(), key=lambda f: place[f.apply.__module__]))


REGISTRY: tuple[Fault, ...] = _in_order()
"""Every fault with its catalogue entries, in `MODULES` order."""

FAULTS: dict[str, Callable[[], None]] = {f.name: f.apply for f in REGISTRY}
"""Fault name -> the function that injects it."""

__all__ = ["FAULTS", "MODULES", "NVFP4_MOE_KERNEL_FAULTS", "REGISTRY", "inject"]


def inject(names: tuple[str, ...] | list[str]) -> None:
    """Apply the named faults in this process."""
    for name in names:
        FAULTS[name]()
