"""Rank groups for checks: one group per TP size, started lazily, reused by every check, and
restarted after a rank failure tore it down. Every call yields one record per rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freetoken.distributed import Placement, RankError, RankGroup, RankTimeout


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
    """A check's rank function failed on some rank; `records` says which and why."""

    def __init__(self, records: list[RankRecord]):
        self.records = records
        bad = [r for r in records if not r.ok]
        first = bad[0]
        last_line = first.error.strip().splitlines()[-1] if first.error.strip() else ""
        super().__init__(f"rank {first.rank}: {last_line}")

    def detail(self) -> str:
        return "\n".join(f"--- rank {r.rank} ---\n{r.error}" for r in self.records if not r.ok)


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

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[RankRecord]:
        """`fn(ctx, *args)` on every rank; raises RankFailure naming the failing rank."""
        try:
            if self._group is None:
                self._start()
            values = self._group.run(fn, *args)
        except RankError as e:
            self._group = None
            raise RankFailure(self._records_for_error(e.rank, e.detail)) from None
        except RankTimeout as e:
            self._group = None
            raise RankFailure([
                RankRecord(r, error=f"timed out after {self.timeout:.0f}s\n{e.stacks[r]}")
                if r in e.stacks else RankRecord(r, error="torn down after a rank timed out")
                for r in range(self.tp_size)]) from None
        return [RankRecord(r, v) for r, v in enumerate(values)]

    def _records_for_error(self, rank: int, detail: str) -> list[RankRecord]:
        return [RankRecord(r, error=detail if r == rank else f"torn down after rank {rank} failed")
                for r in range(self.tp_size)]

    def _start(self) -> None:
        group = RankGroup(self.tp_size, self.placement, self.timeout, self.env)
        group.start()
        self._group = group
        if self.setup is not None:
            group.run(_call_setup, self.setup)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


def _call_setup(ctx, setup) -> None:
    setup()
