"""A rank group leaves nothing behind, whatever ends its parent: SIGKILL while the ranks
start, sit idle or run a call (the ranks exit without a word and remove the group's temp
directories themselves)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

_DRIVER = Path(__file__).with_name("lifecycle_driver.py")
_GONE_WITHIN_S = 10.0


def _make_driver(tmp_path: Path, point: str, *flags: str) -> tuple[subprocess.Popen, list[int]]:
    """The driver at `point`, with its TMPDIR in `tmp_path`; returns it and the pids it
    printed (its ranks and their fork server) once it says `ready`."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    # stderr goes to a file: orphaned ranks would keep a pipe open after the driver died.
    err = open(tmp_path / "stderr.txt", "w")  # noqa: SIM115 - closed right below
    with err:
        proc = subprocess.Popen([sys.executable, str(_DRIVER), point, *flags],
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env=dict(os.environ, TMPDIR=str(tmpdir)))
    pids: list[int] = []
    for line in proc.stdout:
        if line.startswith("pids "):
            pids = [int(p) for p in line.split()[1:]]
        if line.strip() == "ready":
            return proc, pids
    proc.wait(timeout=30)
    raise AssertionError(f"the driver ended before {point!r} (exit {proc.returncode}):\n"
                         f"{_stderr(tmp_path)}")


def _stderr(tmp_path: Path) -> str:
    return (tmp_path / "stderr.txt").read_text()


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def _assert_nothing_left(tmp_path: Path, pids: list[int], what: str) -> None:
    """Within a bounded wait: every pid gone and the driver's TMPDIR empty."""
    tmpdir = tmp_path / "tmp"
    deadline = time.monotonic() + _GONE_WITHIN_S
    while time.monotonic() < deadline and (_alive(pids) or any(tmpdir.iterdir())):
        time.sleep(0.1)
    alive = _alive(pids)
    for pid in alive:
        psutil.Process(pid).kill()
    assert not alive, f"{what}: processes {alive} still running {_GONE_WITHIN_S:.0f}s later"
    left = sorted(p.name for p in tmpdir.iterdir())
    assert not left, f"{what}: left in TMPDIR: {left}"


def _finish(proc: subprocess.Popen, timeout: float = 60) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize("point", ["start", "idle", "run"])
def test_sigkilled_parent_leaves_no_rank_no_directory_and_no_output(tmp_path, point):
    """SIGKILL of the parent while rank 0 waits for a rank 1 never started, while the ranks
    sit idle, or while they run a call that then returns a tensor: every rank and the fork
    server exit, the group's directory and the parent's multiprocessing directory are
    removed, and nothing at all is printed."""
    proc, pids = _make_driver(tmp_path, point)
    if point == "run":
        time.sleep(0.5)  # inside the call
    proc.kill()
    code = _finish(proc)
    assert code == -signal.SIGKILL, f"driver exit {code}\n{_stderr(tmp_path)}"
    assert pids, "the driver printed no pids"
    _assert_nothing_left(tmp_path, pids, f"SIGKILL at {point}")
    assert _stderr(tmp_path) == "", f"printed after SIGKILL at {point}:\n{_stderr(tmp_path)}"
