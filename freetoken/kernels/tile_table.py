"""The measured tile tables the decode kernels read: a JSON file named by an environment
variable (what a bench script's `--write` produced) when set, else the table shipped for the
H200."""

from __future__ import annotations

import json
import os
from collections.abc import Callable


def read_tile_table(env_var: str, shipped: Callable[[], dict]) -> dict:
    """The table at `$env_var`, else `shipped()`; ValueError naming the variable and the file
    when it is not a readable JSON table."""
    path = os.environ.get(env_var)
    if not path:
        return shipped()
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{env_var}={path}: not a readable JSON tile table ({err})") from err


def spell_tiles(numbers: tuple[int, ...], rows: bool) -> str:
    """A table entry: the numbers joined by `/`, with an `r` before them for a row kernel."""
    return ("r" if rows else "") + "/".join(str(n) for n in numbers)


def parse_tiles(cls, entry: str, spelling: str):
    """`cls(*numbers, rows=...)` from an entry `spell_tiles` wrote; ValueError naming the
    entry and the `spelling` expected."""
    rows = entry.startswith("r")
    try:
        return cls(*(int(v) for v in entry[rows:].split("/")), rows=rows)
    except (TypeError, ValueError) as err:
        raise ValueError(f"tile table entry {entry!r} is not {spelling}") from err
