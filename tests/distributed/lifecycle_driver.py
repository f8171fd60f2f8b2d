"""A command that drives a 2-rank group to one point of its life and waits there, for the
lifecycle tests to kill or signal it: `python lifecycle_driver.py POINT [--signals]
[--sigterm]`.

Points: `start` (rank 0 started, rank 1 not yet), `idle` (started, no call), `run` (inside a
call), `fork` (the process signals itself right after a rank's fork, before the group can
record it), `close` (it signals itself while the ranks are stopping); `imported` prints how
each rank's SIGINT was set while it imported this file (`sigint ignored ignored`). On stdout
it prints `pids P...` (its rank and fork-server pids) once they exist, then `ready` at the
point. With `--signals` it runs under `stop_on_signals`, as the commands do.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from multiprocessing import forkserver, process

import psutil
import torch

from freetoken.distributed import RankGroup, choose_placement, stop_on_signals

# Read by a rank while it imports this file as its parent's main module, before any of the
# group's own code runs in it.
_SIGINT_WHILE_IMPORTED = signal.getsignal(signal.SIGINT)


def _rank_tensor(ctx) -> torch.Tensor:
    return torch.arange(4.0) + ctx.rank


def _rank_sleep_then_tensor(ctx, seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return torch.ones(2) * ctx.rank


def _rank_sigint_while_imported(ctx) -> str:
    return {signal.SIG_IGN: "ignored", signal.SIG_DFL: "default"}.get(
        _SIGINT_WHILE_IMPORTED, "KeyboardInterrupt")


def _say(line: str) -> None:
    print(line, flush=True)


def _family(pids: list[int]) -> list[int]:
    """The rank pids and their fork server (their parent, when it is not this process)."""
    servers = {psutil.Process(p).ppid() for p in pids} - {os.getpid()}
    return pids + sorted(servers)


def _pause_after_first_spawn() -> None:
    real = RankGroup._spawn

    def spawn(self, ctx, rank):
        real(self, ctx, rank)
        if rank == 0:
            _say("pids " + " ".join(map(str, _family([self._procs[0].pid]))))
            _say("ready")
            time.sleep(600)

    RankGroup._spawn = spawn


def _signal_right_after_fork(signum: int) -> None:
    """Send `signum` to this process the moment the fork server reports rank 1's pid: after
    the fork, before multiprocessing (or the group) has recorded the new process."""
    real_start, real_read = process.BaseProcess.start, forkserver.read_signed
    starting: list[str] = []

    def start(self):
        starting.append(self.name)
        real_start(self)

    def read_signed(fd):
        pid = real_read(fd)
        if starting and starting[-1] == "freetoken-rank1":
            starting.clear()
            server = psutil.Process(psutil.Process(pid).ppid())
            _say("pids " + " ".join(str(p.pid) for p in server.children()) + f" {server.pid}")
            _say("ready")
            os.kill(os.getpid(), signum)  # a handler not held back raises right here
        return pid

    process.BaseProcess.start = start
    forkserver.read_signed = read_signed


def _signal_while_stopping(group: RankGroup, signum: int) -> None:
    real_join = process.BaseProcess.join

    def join(self, timeout=None):
        process.BaseProcess.join = real_join
        os.kill(os.getpid(), signum)
        time.sleep(2.0)
        return real_join(self, timeout)

    process.BaseProcess.join = join


def drive(point: str, signum: int) -> None:
    if point == "start":
        _pause_after_first_spawn()
    if point == "fork":
        _signal_right_after_fork(signum)
    group = RankGroup(2, choose_placement("cpu", 2), timeout=300)
    group.start()
    pids = [p.pid for p in group._procs]
    _say("pids " + " ".join(map(str, _family(pids))))
    group.run(_rank_tensor)  # the ranks now hold sockets in this process's pymp-* directory
    if point == "imported":
        _say("sigint " + " ".join(group.run(_rank_sigint_while_imported)))
        group.close()
        return
    if point == "idle":
        _say("ready")
        time.sleep(600)
    if point == "run":
        _say("ready")
        group.run(_rank_sleep_then_tensor, 1.5)
        time.sleep(600)
    if point == "close":
        _signal_while_stopping(group, signum)
        _say("ready")
        group.close()
        time.sleep(600)


def main() -> None:
    point = sys.argv[1]
    signum = signal.SIGTERM if "--sigterm" in sys.argv else signal.SIGINT
    if "--signals" in sys.argv:
        with stop_on_signals():
            drive(point, signum)
    else:
        drive(point, signum)


if __name__ == "__main__":
    main()
