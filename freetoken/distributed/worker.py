"""The rank side of a rank group: join the process group, then serve calls from the parent
until told to stop, reporting any failure as a RankFault. Workers watch the parent and exit
when it is gone; they ignore SIGINT (the parent decides teardown) and dump their Python stack
on SIGUSR1 (the parent's timeout asks for it)."""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from freetoken.distributed.failures import fault_from_exception
from freetoken.distributed.placement import Placement


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


def _watch_parent(parent_pid: int, rank: int, tmp: str) -> None:
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            if rank == 0:  # the dead parent cannot remove the group's directory any more
                shutil.rmtree(tmp, ignore_errors=True)
            os._exit(3)


def worker_main(rank, size, placement, tmp, conn, parent_pid, env) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(env)
    # Ctrl-C reaches the whole terminal process group; the parent alone decides teardown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # tqdm's default lock is a multiprocessing semaphore; a rank killed at teardown would leave
    # it registered and the resource tracker would warn about it after the command's last line.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    stack_file = open(Path(tmp) / f"stack-{rank}.txt", "w")  # noqa: SIM115 - lives with the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent_pid, rank, tmp), daemon=True).start()
    try:
        ctx = _init_rank(rank, size, placement, tmp)
        conn.send(("ok", None))
    except BaseException as e:
        _send_error(conn, rank, e)
        return
    _serve(ctx, conn)


def _send_error(conn, rank: int, exc: BaseException) -> None:
    conn.send(("error", fault_from_exception(rank, exc, traceback.format_exc(), time.time())))


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
            except BaseException as e:
                _send_error(conn, ctx.rank, e)
                return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
