"""The rank side of a rank group: join the process group, then serve calls from the parent
until told to stop, reporting any failure as a RankFault. Workers watch the parent and, when
it is gone, remove what the group left in TMPDIR and exit without a word (`rankdir.py`);
they ignore SIGINT (the parent decides teardown) and dump their Python stack on SIGUSR1 (the
parent's timeout asks for it)."""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from freetoken.distributed import rankdir
from freetoken.distributed.failures import fault_from_exception
from freetoken.distributed.placement import Placement

# How often a rank checks that its parent still runs.
_WATCH_S = 0.5
# How long the last rank out waits for a parent that closed its pipe to be gone.
_PARENT_EXIT_WAIT_S = 2.0
# The exit status of a rank that ended because its parent was gone (nobody reads it: the
# parent is gone; it tells such an exit apart when one is traced).
EXIT_PARENT_GONE = 3


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


class _Parent:
    """The rank's line to its parent, and the one way out when the parent is gone or has
    let go of the group (found by the watcher, at the pipe's end, or by a reply that cannot
    be sent): `leave` gives up the rank's place in the group's directory, the last rank out
    removing it (and the dead parent's multiprocessing directory), and ends without a word.
    Nothing is flushed: whatever the rank printed now would come after its parent's last
    line."""

    def __init__(self, conn, pid: int, tmp: str, rank: int):
        self.conn = conn
        self.pid = pid
        self.tmp = tmp
        self.rank = rank
        self._leaving = threading.Lock()

    def leave(self) -> NoReturn:
        with self._leaving:  # the watcher and the serving thread may both find it gone
            if rankdir.leave(self.tmp, self.rank) and self._gone_soon():
                rankdir.remove_parents_mp_dir()
            os._exit(EXIT_PARENT_GONE)

    def _gone_soon(self) -> bool:
        """Whether the parent is gone, or goes within a moment: the pipe's end reaches a
        rank while the parent is still exiting (its files are closed before it is a zombie).
        A parent that stays has only let go of the group, and keeps its directories."""
        deadline = time.monotonic() + _PARENT_EXIT_WAIT_S
        while rankdir.parent_alive(self.pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def watch(self) -> None:
        while True:
            time.sleep(_WATCH_S)
            if not rankdir.parent_alive(self.pid):
                self.leave()

    def receive(self) -> tuple:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.leave()

    def send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError):
            self.leave()
        except BaseException:
            # A reply that cannot be pickled is the call's own error, unless the parent went
            # meanwhile (a tensor's socket cannot be made once its directory is gone).
            if not rankdir.parent_alive(self.pid):
                self.leave()
            raise

    def send_error(self, exc: BaseException) -> None:
        self.send(("error", fault_from_exception(self.rank, exc, traceback.format_exc(),
                                                 time.time())))


def worker_main(rank, size, placement, tmp, conn, parent_pid, env) -> None:
    stack_file = rankdir.join(tmp, rank)
    if stack_file is None:  # the group ended before this rank began
        os._exit(EXIT_PARENT_GONE)
    parent = _Parent(conn, parent_pid, tmp, rank)
    import torch

    torch.set_num_threads(1)
    os.environ.update(env)
    # Ctrl-C reaches the whole terminal process group; the parent alone decides teardown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # tqdm's default lock is a multiprocessing semaphore; a rank killed at teardown would leave
    # it registered and the resource tracker would warn about it after the command's last line.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(target=parent.watch, daemon=True).start()
    try:
        ctx = _init_rank(rank, size, placement, tmp)
    except BaseException as e:
        parent.send_error(e)
        return
    parent.send(("ok", None))
    _serve(ctx, parent)


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


def _serve(ctx: RankContext, parent: _Parent) -> None:
    import torch.distributed as dist

    try:
        while True:
            kind, fn, args = parent.receive()
            if kind == "stop":
                return
            try:
                parent.send(("ok", fn(ctx, *args)))
            except BaseException as e:
                parent.send_error(e)
                return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
