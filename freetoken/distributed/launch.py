"""A persistent group of TP rank processes that runs functions on every rank.

Start the group once, run many functions in it, close it. A rank that raises or dies tears
the group down and the root failure (see `failures.py`) reaches the caller as a RankError; a
rank that hangs is killed at the timeout after its Python stack was dumped; a main module
that starts ranks at import time is a MainModuleError (`bootstrap.py`); workers watch the
parent and, when it is gone, remove the group's directory and exit (`rankdir.py`).
`close_all_groups` kills every running group at once (the signal handlers of `signals.py`
call it); a signal never falls between a rank's fork and its record (`deferred.py`).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import tempfile
import time
import weakref
from collections.abc import Callable
from multiprocessing import forkserver, resource_tracker
from multiprocessing import util as mp_util
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from freetoken.distributed import rankdir
from freetoken.distributed.bootstrap import (
    bootstrap_fault,
    raise_if_bootstrap,
    refuse_start_while_importing_main,
)
from freetoken.distributed.deferred import signals_deferred, start_ignoring_sigint
from freetoken.distributed.failures import (
    RankError,
    RankFault,
    RankTimeout,
    exit_reason,
    root_fault,
)
from freetoken.distributed.placement import Placement
from freetoken.distributed.worker import RankContext, worker_main

__all__ = ["RankContext", "RankError", "RankGroup", "RankTimeout", "close_all_groups",
           "preload_in_ranks"]

# How long the parent keeps listening after a first failure: the other ranks' reports of the
# same incident arrive within it, and the root cause is chosen among them.
_GRACE_S = 0.3
# How long ranks asked to stop get before they are killed, all of them together.
_STOP_WAIT_S = 5.0
# Every running group of this process, for close_all_groups.
_LIVE: weakref.WeakSet = weakref.WeakSet()


_MP = None
# What the forkserver imports before it forks a rank: torch, and what `preload_in_ranks` added.
_PRELOAD = ["torch", "torch.distributed"]


def preload_in_ranks(*modules: str) -> None:
    """Have the ranks' forkserver import `modules` too, so that every rank starts with them
    imported instead of importing them itself (a few tenths of a second per rank, much of a
    small group's start on two cores). It counts for the forkserver this process starts at
    its first group; a module that touches CUDA, starts a thread or imports triton must not
    be named (every rank is forked from that server)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _mp_context():
    """forkserver with torch (and `preload_in_ranks`'s modules) preloaded: each rank forks a
    warm interpreter instead of re-importing torch, and the server never touches CUDA or a
    thread pool. It is started with SIGINT ignored, which every rank inherits (see
    `deferred.start_ignoring_sigint`)."""
    global _MP
    if _MP is None:
        _MP = mp.get_context("forkserver")
        _MP.set_forkserver_preload(list(_PRELOAD))
        resource_tracker.ensure_running()  # it unblocks SIGINT when it starts
        start_ignoring_sigint(forkserver.ensure_running)
        # A group still running when the interpreter exits would otherwise be ended by
        # multiprocessing's own exit hook (SIGTERM), which leaves its directory behind.
        atexit.register(close_all_groups)
    return _MP


class RankGroup:
    """`tp_size` rank processes joined in one torch.distributed group."""

    def __init__(
        self,
        tp_size: int,
        placement: Placement,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
    ):
        self.tp_size = tp_size
        self.placement = placement
        self.timeout = timeout
        self.env = dict(env or {})
        self._procs: list = []
        self._conns: list = []
        self._tmp: Path | None = None

    def __enter__(self) -> RankGroup:
        self.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(force=exc_type is not None)

    def start(self) -> None:
        """Start the ranks and wait until every one has joined the process group. Whatever
        stops it (a rank's failure, the timeout, a signal) stops the ranks already running
        and removes the group's directory before the error propagates."""
        refuse_start_while_importing_main()
        ctx = _mp_context()
        # multiprocessing's socket directory (pymp-*), made now so that every rank inherits
        # this process's: a rank sending a tensor would otherwise make its own, which stays
        # behind when the rank is killed. This process removes it at exit (or, when this
        # process is killed, the last rank out does).
        mp_util.get_temp_dir()
        with signals_deferred():  # a directory not yet known to close_all_groups would stay
            self._tmp = Path(tempfile.mkdtemp(prefix="freetoken-ranks-"))
            _LIVE.add(self)
        try:
            for rank in range(self.tp_size):
                self._spawn(ctx, rank)
            self._collect(self.timeout, "starting")
        except BaseException:
            self.close(force=True)
            raise

    def _spawn(self, ctx, rank: int) -> None:
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=worker_main,
            args=(rank, self.tp_size, self.placement, str(self._tmp), child, os.getpid(),
                  self.env),
            daemon=True,
            name=f"freetoken-rank{rank}",
        )
        # A signal between the fork and the bookkeeping would leave a rank nobody stops.
        with signals_deferred():
            try:
                proc.start()
            except BaseException:
                parent.close()
                raise
            finally:
                child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    @property
    def running(self) -> bool:
        return bool(self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list:
        """Run `fn(ctx, *args)` on every rank; returns the per-rank results in rank order.
        A rank that is gone (died while idle, or its pipe broke) is a RankError naming it."""
        if not self._procs:
            raise RuntimeError("rank group is not running")
        what = getattr(fn, "__name__", "a call")
        sent = 0
        try:
            for rank, (proc, conn) in enumerate(zip(self._procs, self._conns)):
                if not proc.is_alive():
                    self._fail([self._death(rank, "while idle")])
                try:
                    conn.send(("call", fn, args))
                except OSError as e:
                    self._fail([RankFault(rank, "died", f"{type(e).__name__}: {e} (sending "
                                          f"{what})", f"pipe to rank {rank} broke: {e}")])
                sent += 1
            return self._collect(self.timeout if timeout is None else timeout, f"in {what}")
        except BaseException:
            # A call cut short (a signal) leaves replies in the pipes that the next call would
            # take for its own: the group ends with it. (A function that cannot be pickled is
            # refused before any rank got it, and the group stays.)
            if sent:
                self.close(force=True)
            raise

    def _collect(self, timeout: float, doing: str) -> list:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        while len(results) < self.tp_size:
            pending = [r for r in range(self.tp_size) if r not in results]
            ready = self._wait(pending, max(0.0, deadline - time.monotonic()))
            if not ready:
                stacks = self._dump_stacks(pending)
                self.close(force=True)
                raise RankTimeout(timeout, stacks)
            faults = []
            for rank in ready:
                fault, value = self._receive(rank, doing)
                if fault is None:
                    results[rank] = value
                else:
                    faults.append(fault)
            if faults:
                self._fail(faults + self._late_faults(pending, faults, doing))
        return [results[r] for r in range(self.tp_size)]

    def _wait(self, ranks: list[int], timeout: float) -> list[int]:
        waitables = {self._conns[r]: r for r in ranks}
        waitables.update({self._procs[r].sentinel: r for r in ranks})
        return sorted({waitables[obj] for obj in wait(list(waitables), timeout=timeout)})

    def _receive(self, rank: int, doing: str) -> tuple[RankFault | None, Any]:
        """(None, result) for a rank that answered, (its RankFault, None) for one that
        reported an error or is gone."""
        try:
            status, payload = self._conns[rank].recv()
        except (EOFError, OSError):
            return self._death(rank, doing), None
        return (payload, None) if status == "error" else (None, payload)

    def _late_faults(self, pending: list[int], seen: list[RankFault], doing: str) -> list:
        """Reports of the same incident from ranks that answer within the grace period."""
        known = {f.rank for f in seen}
        later = []
        for rank in self._wait([r for r in pending if r not in known], _GRACE_S):
            fault, _ = self._receive(rank, doing)
            if fault is not None:
                later.append(fault)
        return later

    def _death(self, rank: int, doing: str) -> RankFault:
        proc = self._procs[rank]
        proc.join(1)
        if doing == "starting":
            began = rankdir.stack_path(self._tmp, rank).exists()
            fault = bootstrap_fault(rank, proc.exitcode, began, time.time())
            if fault is not None:
                return fault
        reason = exit_reason(proc.exitcode)
        return RankFault(rank, "died", f"process died ({reason}) {doing}",
                         f"rank {rank} (pid {proc.pid}) exited {doing} without a result: "
                         f"{reason}", time.time())

    def _fail(self, faults: list[RankFault]) -> None:
        root = root_fault(faults)
        self.close(force=True)
        raise_if_bootstrap(faults)
        raise RankError.from_fault(root, faults, self.tp_size)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        stacks = {}
        for rank in ranks:
            path = rankdir.stack_path(self._tmp, rank)
            stacks[rank] = path.read_text() if path.exists() else ""
        return stacks

    def close(self, force: bool = False) -> None:
        """Stop every rank: ask them to stop and give them a few seconds together; with
        `force` (or past that), kill all of them at once."""
        if not force:
            for conn in self._conns:
                try:
                    conn.send(("stop", None, None))
                except OSError:
                    continue  # that rank is already gone; killing below covers it
            deadline = time.monotonic() + _STOP_WAIT_S
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmp is not None:
            rankdir.remove(self._tmp)
            self._tmp = None
        _LIVE.discard(self)


def close_all_groups() -> int:
    """Kill every rank group of this process at once (on SIGINT / SIGTERM); returns how many
    rank processes were running."""
    groups = list(_LIVE)
    count = sum(len(g._procs) for g in groups)
    for group in groups:
        for proc in group._procs:
            if proc.is_alive():
                proc.kill()
    for group in groups:
        group.close(force=True)
    return count
