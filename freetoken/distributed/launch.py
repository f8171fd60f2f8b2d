"""A persistent group of TP rank processes that runs functions on every rank.

Start the group once, run many functions in it, close it. A rank that raises tears the group
down and its traceback reaches the caller; a rank that hangs is killed at the timeout after its
Python stack was dumped; workers watch the parent and exit when it is gone.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from freetoken.distributed.placement import Placement


class RankError(RuntimeError):
    """A rank raised or died; carries the rank id and its traceback."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        last = detail.strip().splitlines()[-1] if detail.strip() else "no output"
        super().__init__(f"rank {rank} failed: {last}")


class RankTimeout(RuntimeError):
    """Ranks did not answer in time; carries each hung rank's Python stack."""

    def __init__(self, timeout: float, stacks: dict[int, str]):
        self.timeout = timeout
        self.stacks = stacks
        ranks = ", ".join(str(r) for r in sorted(stacks))
        super().__init__(f"rank(s) {ranks} did not finish within {timeout:.0f}s")

    def describe(self) -> str:
        parts = [str(self)]
        for rank, stack in sorted(self.stacks.items()):
            parts.append(f"--- rank {rank} stack ---\n{stack.strip() or '(no stack captured)'}")
        return "\n".join(parts)


@dataclass
class RankContext:
    """What a function run on a rank receives: identity, device and per-process state."""

    rank: int
    size: int
    placement: Placement
    state: dict = field(default_factory=dict)

    @property
    def device(self):
        return self.placement.device_for(self.rank)


_MP = None


def _mp_context():
    """forkserver with torch preloaded: each rank forks a warm interpreter instead of
    re-importing torch, and the server never touches CUDA or a thread pool."""
    global _MP
    if _MP is None:
        _MP = mp.get_context("forkserver")
        _MP.set_forkserver_preload(["torch", "torch.distributed"])
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

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        ctx = _mp_context()
        self._tmp = Path(tempfile.mkdtemp(prefix="freetoken-ranks-"))
        for rank in range(self.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.tp_size, self.placement, str(self._tmp), child, os.getpid(),
                      self.env),
                daemon=True,
                name=f"freetoken-rank{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(self.timeout)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list:
        """Run `fn(ctx, *args)` on every rank; returns the per-rank results in rank order."""
        if not self._procs:
            raise RuntimeError("rank group is not running")
        for conn in self._conns:
            conn.send(("call", fn, args))
        return self._collect(self.timeout if timeout is None else timeout)

    def _collect(self, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        while len(results) < self.tp_size:
            pending = [r for r in range(self.tp_size) if r not in results]
            waitables = {self._conns[r]: r for r in pending}
            waitables.update({self._procs[r].sentinel: r for r in pending})
            ready = wait(list(waitables), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                stacks = self._dump_stacks(pending)
                self.close(force=True)
                raise RankTimeout(timeout, stacks)
            for obj in ready:
                rank = waitables[obj]
                if rank in results:
                    continue
                try:
                    status, payload = self._conns[rank].recv()
                except EOFError:
                    self._procs[rank].join(1)
                    code = self._procs[rank].exitcode
                    self.close(force=True)
                    raise RankError(rank, f"process exited with code {code} without a result "
                                          "(see its output above)") from None
                if status == "error":
                    self.close(force=True)
                    raise RankError(rank, payload)
                results[rank] = payload
        return [results[r] for r in range(self.tp_size)]

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        stacks = {}
        for rank in ranks:
            path = self._tmp / f"stack-{rank}.txt"
            stacks[rank] = path.read_text() if path.exists() else ""
        return stacks

    def close(self, force: bool = False) -> None:
        """Stop every rank; with `force`, kill without asking."""
        if not force:
            for conn in self._conns:
                try:
                    conn.send(("stop", None, None))
                except (OSError, BrokenPipeError):
                    pass
            for proc in self._procs:
                proc.join(10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)


def _worker_main(rank, size, placement, tmp, conn, parent_pid, env) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(env)
    # tqdm's default lock is a multiprocessing semaphore; a rank killed at teardown would leave
    # it registered and the resource tracker would warn about it after the command's last line.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    stack_file = open(Path(tmp) / f"stack-{rank}.txt", "w")  # noqa: SIM115 - lives with the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        ctx = _init_rank(rank, size, placement, tmp)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    _serve(ctx, conn)


def _init_rank(rank: int, size: int, placement: Placement, tmp: str) -> RankContext:
    import torch
    import torch.distributed as dist

    from freetoken.distributed.comm import Communicator, set_communicator
    from freetoken.distributed.tpinfo import TPInfo, set_tp_info

    if placement.is_cuda:
        torch.cuda.set_device(placement.device_for(rank))
    store = dist.FileStore(str(Path(tmp) / "store"), size)
    kwargs = {"device_id": placement.device_for(rank)} if placement.backend == "nccl" else {}
    dist.init_process_group(placement.backend, store=store, rank=rank, world_size=size, **kwargs)
    set_tp_info(TPInfo(rank, size))
    set_communicator(Communicator(size))
    return RankContext(rank, size, placement)


def _serve(ctx: RankContext, conn) -> None:
    import torch.distributed as dist

    try:
        while True:
            try:
                kind, fn, args = conn.recv()
            except EOFError:
                return
            if kind == "stop":
                return
            try:
                conn.send(("ok", fn(ctx, *args)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
                return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
