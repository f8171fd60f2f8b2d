"""Option values shared by the command line and the run: exit codes and the parsing of
comma-separated, repeatable options."""

from __future__ import annotations

import click

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def split_values(values: tuple[str, ...], option: str = "") -> list[str]:
    """Comma-separated values of a repeatable option; an empty entry (`--model ''`, often an
    unset shell variable) is a usage error, never 'use the default'."""
    items = [v.strip() for value in values for v in value.split(",")]
    if option and any(not v for v in items):
        raise click.UsageError(f"{option}: empty value in {list(values)!r} (an unset variable?)")
    return [v for v in items if v]


def is_count(text: str) -> bool:
    """A positive integer in ASCII digits."""
    # str.isdigit() also accepts '²' and other Unicode digits that int() then rejects.
    return text.isascii() and text.isdigit() and int(text) >= 1


def parse_tp(values: tuple[str, ...]) -> list[int]:
    """The distinct TP sizes of `--tp` values, ascending; a usage error names a bad one."""
    sizes = []
    for v in split_values(values, "--tp"):
        if not is_count(v):
            raise click.UsageError(f"--tp: {v!r} is not a TP size (a positive integer)")
        sizes.append(int(v))
    return sorted(set(sizes))
