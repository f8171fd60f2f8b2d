"""The rank group's temporary directory, seen from the ranks.

The parent creates the directory and removes it when it closes the group. When the parent is
gone (SIGKILL, a crash) the ranks remove it themselves: each rank holds its own file there
(`stack-R.txt`, where its Python stack is dumped on request) under an exclusive lock kept for
the life of its process, so the kernel releases the lock however the rank ends. A rank that
leaves deletes its file and then looks for a peer whose file is still locked; the one that
finds none is the last out and removes the directory. Two ranks leaving together cannot both
miss each other (each deletes its own file before it looks), and a rank still starting finds
the directory gone and ends quietly.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import shutil
from pathlib import Path
from typing import IO

_STACK_PREFIX = "stack-"


def stack_path(tmp: str | Path, rank: int) -> Path:
    """Where rank `rank` dumps its Python stack (and holds its place in the group)."""
    return Path(tmp) / f"{_STACK_PREFIX}{rank}.txt"


def join(tmp: str | Path, rank: int) -> IO[str] | None:
    """Open and lock this rank's file in the group's directory, for the life of the process;
    None when the directory is gone: the group ended before this rank began."""
    try:
        file = open(stack_path(tmp, rank), "w")  # noqa: SIM115 - lives with the process
    except FileNotFoundError:
        return None
    fcntl.flock(file, fcntl.LOCK_EX)
    return file


def leave(tmp: str | Path, rank: int) -> bool:
    """Give up this rank's place; the last rank out removes the directory. Returns whether
    this call removed it."""
    with contextlib.suppress(FileNotFoundError):  # the directory went before this rank
        stack_path(tmp, rank).unlink()
    try:
        names = os.listdir(tmp)
    except FileNotFoundError:
        return False
    if any(_held(Path(tmp) / n) for n in names if n.startswith(_STACK_PREFIX)):
        return False
    return remove(tmp)


def remove(tmp: str | Path) -> bool:
    """Remove the directory for good: renamed first (atomically), so that no process can
    create anything in it while it is being deleted. Returns whether this call removed it
    (False: it was already gone)."""
    claimed = Path(f"{tmp}.removing-{os.getpid()}")
    try:
        os.rename(tmp, claimed)
    except FileNotFoundError:
        return False
    shutil.rmtree(claimed, ignore_errors=True)
    return True


def _held(path: Path) -> bool:
    """Whether a live rank holds this file's lock (a rank that died left it unlocked)."""
    try:
        file = open(path)  # noqa: SIM115 - closed below, which also drops a lock taken here
    except FileNotFoundError:
        return False
    with file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def parent_alive(pid: int) -> bool:
    """Whether process `pid` (the rank group's parent) still runs: not gone, not a zombie,
    not a stranger that inherited its pid."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (not Linux): the signal test above is all there is
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def remove_parents_mp_dir() -> None:
    """Remove the dead parent's multiprocessing directory (pymp-*, which ranks inherit and
    hold their sockets in): its owner would have removed it at exit, and nobody else will."""
    tmp = multiprocessing.current_process()._config.get("tempdir")
    if tmp and Path(tmp).name.startswith("pymp-"):
        shutil.rmtree(tmp, ignore_errors=True)
