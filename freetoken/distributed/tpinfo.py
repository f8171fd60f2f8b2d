"""Frozen per-process tensor-parallel identity, set once per rank."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid TP rank {self.rank} for tp_size={self.size}")

    @property
    def is_first(self) -> bool:
        return self.rank == 0


_TP_INFO: TPInfo | None = None


def set_tp_info(info: TPInfo) -> None:
    """Record this process's TP identity; a second, different value is a bug."""
    global _TP_INFO
    if _TP_INFO is not None and _TP_INFO != info:
        raise RuntimeError(f"TP info already set to {_TP_INFO}, refusing {info}")
    _TP_INFO = info


def reset_tp_info() -> None:
    """Forget the TP identity (for in-process TP=1 engines and tests)."""
    global _TP_INFO
    _TP_INFO = None


def get_tp_info() -> TPInfo:
    """This process's TP identity; TP=1 when no group was started."""
    return _TP_INFO if _TP_INFO is not None else TPInfo()


def divide(total: int, size: int, what: str) -> int:
    """`total // size`, or a ValueError naming the dimension that cannot be split."""
    if total % size:
        raise ValueError(f"{what}={total} cannot be split across tp_size={size}")
    return total // size


@contextmanager
def acting_as(info: TPInfo) -> Iterator[TPInfo]:
    """Run a block with `info` as this process's TP identity, then put back exactly what was
    there (unset included). For building one rank's layers of another TP size in a process
    that holds its own (the harness's kernels check builds every TP size's layers on rank 0);
    nothing in the block may talk to the rank group, whose size is still the real one."""
    global _TP_INFO
    saved, _TP_INFO = _TP_INFO, info
    try:
        yield info
    finally:
        _TP_INFO = saved
