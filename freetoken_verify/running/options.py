"""Option values shared by the command line, `verify.run` and the run itself: exit codes,
the choices each option accepts, and the parsing of comma-separated, repeatable options."""

from __future__ import annotations

import math

from freetoken_verify.errors import UsageError

# The harness derives seeds from --seed (prompts: seed + 1000 and + 2000; seeded sampling:
# seed + i per prompt), each of which must stay below the engine's SEED_LIMIT (2**63, a signed
# 64-bit torch seed); kept as a literal so this module imports no torch.
MAX_SEED = 2**63 - 4096
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The engine's short names (freetoken.engine.core.DTYPE_ALIASES; a test keeps the two equal),
# kept as a literal so this module imports no torch.
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
REFERENCES = ("auto", "golden", "hf")
DEFAULT_TP = (1, 2)
DEFAULT_TIMEOUT = 600.0


def split_values(values, option: str = "") -> list[str]:
    """Comma-separated values of a repeatable option; an empty entry (`--model ''`, often an
    unset shell variable) is a usage error, never 'use the default'."""
    items = [v.strip() for value in values for v in value.split(",")]
    if option and any(not v for v in items):
        raise UsageError(f"{option}: empty value in {list(values)!r} (an unset variable?)")
    return [v for v in items if v]


def is_count(text: str) -> bool:
    """A positive integer in ASCII digits."""
    # str.isdigit() also accepts '²' and other Unicode digits that int() then rejects.
    return text.isascii() and text.isdigit() and int(text) >= 1


def parse_tp(values) -> list[int]:
    """The TP sizes of `--tp` values (`"1,2"`, repeatable), in the order given; a usage error
    names a bad one."""
    sizes = []
    for v in split_values(values, "--tp"):
        if not is_count(v):
            raise UsageError(f"--tp: {v!r} is not a TP size (a positive integer)")
        sizes.append(int(v))
    return sizes


def check_choice(option: str, value, choices: tuple[str, ...]) -> str:
    """`value` if it is one of `choices`, else a usage error listing them."""
    if value not in choices:
        raise UsageError(f"{option}: {value!r} is not one of {', '.join(choices)}")
    return value


def check_dtype(option: str, value) -> str:
    """`value` as a dtype name (`auto`, `float32`, ...; an alias such as `bf16` becomes its
    dtype's name), else a usage error listing them."""
    name = DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in DTYPES:
        aliases = ", ".join(f"{a} ({n})" for a, n in DTYPE_ALIASES.items())
        raise UsageError(f"{option}: {value!r} is not one of {', '.join(DTYPES)} or the "
                         f"aliases {aliases}")
    return name


def check_count(option: str, value) -> int:
    """`value` as a positive int; bools and other types are refused."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{option}: {value!r} is not a positive integer")
    return value


def check_seconds(option: str, value) -> float:
    """`value` as a finite number of seconds above zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not (math.isfinite(value) and value > 0):
        raise UsageError(f"{option}: {value!r} is not a finite number of seconds above 0")
    return float(value)


def check_names(option: str, noun: str, values, known, list_known: bool = True) -> list[str]:
    """`values` as a list of strings, each one of `known` (a `noun`); a bare string is one
    name. The error for an unknown name lists the known ones, or points at `--list`."""
    names = [values] if isinstance(values, str) else list(values)
    for name in names:
        if not isinstance(name, str) or not name:
            raise UsageError(f"{option}: {name!r} is not a {noun} name")
        if name not in known:
            where = f"available: {', '.join(known)}" if list_known else \
                "`freetoken-verify --list` shows them"
            raise UsageError(f"unknown {noun} {name!r}; {where}")
    return names
