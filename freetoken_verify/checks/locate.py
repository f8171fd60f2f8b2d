"""Where on a rank an exception came from: the engine module that was running and the innermost
frame inside the `freetoken` package, appended to the exception's first message line
(`split_with_sizes expects ... [in model.layers.0.linear_attn;
freetoken/models/qwen3_5_moe/gdn.py:171 in _heads]`), so that a crashed rank's row says where
the engine broke, not only what broke.

The running modules are read off the traceback (every frame whose `self` is an `nn.Module`),
not kept by forward hooks: a hook stack goes stale when a forward raises and something inside
the engine catches it, and a frame is exactly what was running when the exception was raised.
Module names are the resident engine's (`model.named_modules()`); a module outside it is named
by its class."""

from __future__ import annotations

import traceback
from pathlib import Path
from types import TracebackType

from torch import nn

import freetoken

ENGINE_ROOT = Path(freetoken.__file__).resolve().parent
"""The engine's package folder: frames inside it are the engine's own code (a fault's
replacement function, defined in `freetoken_verify.faults`, is not)."""


def running_modules(tb: TracebackType | None) -> list[nn.Module]:
    """The modules whose methods were on the stack when the exception was raised, outermost
    first (a module appears once, at its outermost frame)."""
    modules: list[nn.Module] = []
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and not any(m is owner for m in modules):
            modules.append(owner)
        tb = tb.tb_next
    return modules


def engine_frame(tb: TracebackType | None) -> str | None:
    """`freetoken/<path>:<line> in <function>` of the innermost frame inside the engine's
    package, or None when the exception never passed through it."""
    inside = [f for f in traceback.extract_tb(tb) if _in_engine(f.filename)]
    if not inside:
        return None
    frame = inside[-1]
    path = Path(frame.filename).resolve().relative_to(ENGINE_ROOT.parent)
    return f"{path.as_posix()}:{frame.lineno} in {frame.name}"


def _in_engine(filename: str) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(ENGINE_ROOT)
    except OSError:
        return False


def module_name(module: nn.Module, model: nn.Module | None) -> str:
    """`module`'s name in `model` (the resident engine's model), else its class name."""
    if model is not None:
        for name, candidate in model.named_modules():
            if candidate is module:
                return name or type(model).__name__
    return type(module).__name__


def location(exc: BaseException, model: nn.Module | None) -> str | None:
    """`in <innermost running module>; <innermost engine frame>` (either part alone where the
    other is unknown), or None when neither is known."""
    modules = running_modules(exc.__traceback__)
    parts = []
    if modules:
        parts.append(f"in {module_name(modules[-1], model)}")
    frame = engine_frame(exc.__traceback__)
    if frame is not None:
        parts.append(frame)
    return "; ".join(parts) or None


def annotate(exc: BaseException, where: str) -> None:
    """Append `[where]` to `exc`'s first message line, in place, keeping its type (a rank's
    failure is classified by its exception type's name). An exception whose message is not
    one string argument gets the location as a note (in its traceback) instead."""
    tag = f"[{where}]"
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        first, newline, rest = exc.args[0].partition("\n")
        located = f"{first} {tag}" if first else tag
        exc.args = (located + newline + rest,)
    elif not exc.args:
        exc.args = (tag,)
    else:
        exc.add_note(tag)
