"""The fault registry. A fault registers itself where it is defined, `@fault(name, Entry(...))`,
with its catalogue entries beside it: where it bites, the checks that must catch it, the words
their failing row must say. `FAULTS` (`freetoken_verify.faults`), `CATALOGUE`
(`freetoken_verify.faults.catalogue`) and the fault list of docs/extending.md are views of
`REGISTERED`, in registration order, so adding a fault is one edit beside its function."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

Apply = TypeVar("Apply", bound=Callable[[], None])


@dataclass(frozen=True)
class Entry:
    """One TP bug class: inject `fault` into `model` and run `checks` at `tp` (TP=1 too when
    `tp1_green`) on `device`: every TP size in `tp` must fail a row whose message matches
    `words` (a regex naming the module, tensor or rank); at TP=1 every row must pass. The run
    is bitwise wherever the tp_invariant mode runs, as on the command line, in `dtype`;
    `bitwise_only`: the same run with `--no-bitwise` passes (measured; docs/verification.md).
    `fault` is left out where the entry is written: `@fault` fills in its own name."""

    bug_class: str
    model: str
    tp: tuple[int, ...]
    checks: tuple[str, ...]
    words: str
    tp1_green: bool = True
    device: str = "cpu"
    dtype: str = "auto"
    bitwise_only: bool = False
    fault: str = ""


@dataclass(frozen=True)
class Fault:
    """One injectable fault: `apply()` patches the engine in the calling process; `entries`
    are its catalogue entries; `proven_by` says where a fault with none is proven instead."""

    name: str
    apply: Callable[[], None]
    entries: tuple[Entry, ...]
    proven_by: str = ""


REGISTERED: dict[str, Fault] = {}
"""Fault name -> its registration, in the order the fault modules register them."""


def fault(name: str, *entries: Entry, proven_by: str = "") -> Callable[[Apply], Apply]:
    """Register the decorated function as fault `name`, with its catalogue `entries` (none,
    one or several). A fault without an entry names the test that proves it (`proven_by`):
    every fault is shown to be caught somewhere. The function comes back unchanged; its
    docstring's first sentence is the description `--list` prints."""

    def register(apply: Apply) -> Apply:
        where = f"{apply.__module__}.{apply.__qualname__}"
        if name in REGISTERED:
            first = REGISTERED[name].apply
            raise ValueError(f"fault {name!r} is registered twice: by "
                             f"{first.__module__}.{first.__qualname__} and by {where}")
        if not (apply.__doc__ or "").strip():
            raise ValueError(f"fault {name!r} ({where}) has no docstring: it is the "
                             "description `--list` prints")
        if not entries and not proven_by:
            raise ValueError(f"fault {name!r} ({where}) has no catalogue entry: give one, or "
                             "proven_by= the test that proves it is caught")
        stray = [e.fault for e in entries if e.fault not in ("", name)]
        if stray:
            raise ValueError(f"fault {name!r} ({where}) carries entries of {stray}")
        REGISTERED[name] = Fault(name, apply, tuple(dataclasses.replace(e, fault=name)
                                                    for e in entries), proven_by)
        return apply

    return register
