"""Rank groups for checks: one group per TP size, started lazily, reused by every check, and
restarted after a rank failure tore it down. Every call yields one record per rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freetoken.distributed import Placement, RankError, RankGroup, RankTimeout, preload_in_ranks
from freetoken_verify.checks.engine_cache import resident_model
from freetoken_verify.checks.locate import annotate, location


@dataclass
class RankRecord:
    """What one rank returned, or why it returned nothing."""

    rank: int
    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class RankFailure(RuntimeError):
    """A check's rank function failed. The message names the root rank and its cause
    (`rank 1: KeyError: ...`, `rank 1 timed out after 15s in f at x.py:3`); `records` hold
    every rank's detail, including the ranks torn down because of it."""

    def __init__(self, records: list[RankRecord], root: int, message: str):
        self.records = records
        self.root = root
        super().__init__(message)

    def detail(self) -> str:
        ordered = sorted((r for r in self.records if not r.ok), key=lambda r: r.rank != self.root)
        return "\n".join(f"--- rank {r.rank} ---\n{r.error}" for r in ordered)

    @classmethod
    def from_error(cls, e: RankError, size: int) -> RankFailure:
        records = [RankRecord(r, error=e.detail if r == e.rank else e.others.get(
            r, f"torn down after rank {e.rank} failed")) for r in range(size)]
        return cls(records, e.rank, f"rank {e.rank}: {e.summary}")

    @classmethod
    def from_timeout(cls, e: RankTimeout, size: int) -> RankFailure:
        records = [RankRecord(r, error=f"timed out after {e.timeout:g}s\n{e.stacks[r]}")
                   if r in e.stacks else
                   RankRecord(r, error=f"torn down after rank {e.rank} timed out")
                   for r in range(size)]
        return cls(records, e.rank, str(e))


RANK_MODULES = ("freetoken.engine.core", "freetoken.models.registry", "freetoken_verify.faults",
                *(f"freetoken_verify.checks.{name}.check"
                  for name in ("golden", "shards", "memory", "kernels", "bisect", "collectives")))
"""What the checks' rank functions import: preloaded by the ranks' forkserver."""


class RankRunner:
    """Runs check functions on `tp_size` ranks with `placement`; the group starts on first
    use and after a failure. `setup` (if given) runs on every rank right after start."""

    def __init__(self, tp_size: int, placement: Placement, timeout: float = 600.0,
                 setup: Callable[..., Any] | None = None, env: dict[str, str] | None = None):
        self.tp_size = tp_size
        self.placement = placement
        self.timeout = timeout
        self.setup = setup
        self.env = env
        self._group: RankGroup | None = None

    def __enter__(self) -> RankRunner:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(force=exc_type is not None)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[RankRecord]:
        """`fn(ctx, *args)` on every rank; raises RankFailure naming the root failing rank
        (the group is then gone, and the next call starts a new one). A rank's exception
        names the engine module and the engine frame it came from (`_located`)."""
        try:
            if self._group is None or not self._group.running:
                self._start()
            values = self._group.run(_located, fn, *args)
        except RankError as e:
            self._group = None
            raise RankFailure.from_error(e, self.tp_size) from None
        except RankTimeout as e:
            self._group = None
            raise RankFailure.from_timeout(e, self.tp_size) from None
        return [RankRecord(r, v) for r, v in enumerate(values)]

    def _start(self) -> None:
        preload_in_ranks(*RANK_MODULES)
        group = RankGroup(self.tp_size, self.placement, self.timeout, self.env)
        self._group = group
        try:
            group.start()
            if self.setup is not None:
                group.run(_call_setup, self.setup)
        except BaseException:
            # Whatever cut the start short, the next call starts afresh.
            self._group = None
            raise

    def close(self, force: bool = False) -> None:
        if self._group is not None:
            self._group.close(force=force)
            self._group = None


def _call_setup(ctx, setup) -> None:
    setup()


def _located(ctx, fn: Callable[..., Any], *args: Any) -> Any:
    """Runs on every rank: `fn(ctx, *args)`; an exception it raises leaves with the module
    and the engine frame that raised it appended to its first line (`locate.annotate`)."""
    try:
        return fn(ctx, *args)
    except Exception as e:
        try:
            where = location(e, resident_model(ctx))
        except Exception as failure:  # locating must never replace the rank's own error
            where = f"location unknown: {type(failure).__name__}: {failure}"
        if where is not None:
            annotate(e, where)
        raise
