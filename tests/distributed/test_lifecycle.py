"""A rank group leaves nothing behind, whatever ends its parent: SIGKILL while the ranks
start, sit idle or run a call (the ranks exit without a word and remove the group's temp
directories themselves), and SIGINT / SIGTERM at any point of the group's life, right after a
rank's fork included (the command's one line is the last thing printed, and every rank and
temp directory is gone)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import short_tmpdir

from freetoken.distributed.deferred import signals_deferred

_DRIVER = Path(__file__).with_name("lifecycle_driver.py")
_GONE_WITHIN_S = 20.0


def _make_driver(tmp_path: Path, point: str, *flags: str) -> tuple[subprocess.Popen, list[int]]:
    """The driver at `point`, with its TMPDIR in `tmp_path`; returns it and the pids it
    printed (its ranks and their fork server) once it says `ready`."""
    tmpdir = short_tmpdir(tmp_path)
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
    tmpdir = short_tmpdir(tmp_path)
    deadline = time.monotonic() + _GONE_WITHIN_S
    while time.monotonic() < deadline and (_alive(pids) or any(tmpdir.iterdir())):
        time.sleep(0.1)
    alive = _alive(pids)
    for pid in alive:
        psutil.Process(pid).kill()
    assert not alive, f"{what}: processes {alive} still running {_GONE_WITHIN_S:.0f}s later"
    left = sorted(p.name for p in tmpdir.iterdir())
    assert not left, f"{what}: left in TMPDIR: {left}"
    tmpdir.rmdir()


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


@pytest.mark.parametrize("point, flag, name, code", [
    ("start", "--sigint", "SIGINT", 130),
    ("fork", "--sigint", "SIGINT", 130),
    ("fork", "--sigterm", "SIGTERM", 143),
    ("run", "--sigterm", "SIGTERM", 143),
    ("close", "--sigint", "SIGINT", 130),
])
def test_signal_at_any_point_prints_one_last_line_and_leaves_nothing(tmp_path, point, flag,
                                                                     name, code):
    """SIGINT / SIGTERM while the group starts (between two ranks, or right after a rank's
    fork, before the group recorded it), while a call runs, or while the ranks stop: exit
    130 / 143, stderr is exactly the one interruption line (nothing from a rank after it),
    no rank and nothing in TMPDIR left."""
    proc, pids = _make_driver(tmp_path, point, "--signals", flag)
    if point in ("start", "run"):  # the others signal themselves
        proc.send_signal(signal.SIGTERM if flag == "--sigterm" else signal.SIGINT)
    got = _finish(proc)
    _assert_nothing_left(tmp_path, pids, f"{name} at {point}")
    time.sleep(0.5)  # a rank that outlived its stop would print by now
    lines = _stderr(tmp_path).strip().splitlines()
    assert got == code, f"{name} at {point}: exit {got}, want {code}\n{_stderr(tmp_path)}"
    assert lines == [f"interrupted by {name}: rank processes stopped"], \
        f"{name} at {point}: stderr is not the one line:\n{_stderr(tmp_path)}"


def test_ranks_ignore_sigint_while_they_still_start(tmp_path):
    """A rank ignores SIGINT from its first instruction on, while it imports the parent's
    main module included: a Ctrl-C reaching the terminal's process group while ranks start
    cannot print a KeyboardInterrupt traceback from a rank."""
    tmpdir = short_tmpdir(tmp_path)
    run = subprocess.run([sys.executable, str(_DRIVER), "imported"], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, TMPDIR=str(tmpdir)))
    shutil.rmtree(tmpdir, ignore_errors=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "sigint ignored ignored", run.stdout


def _make_held(signum: int, times: int) -> list[str]:
    """What happens around a section that receives `signum` `times` times."""
    events = []
    try:
        with signals_deferred():
            for _ in range(times):
                os.kill(os.getpid(), signum)
                time.sleep(0.05)  # the handler runs in here
            events.append("section done")
    except KeyboardInterrupt:
        events.append("KeyboardInterrupt")
    return events


def test_signals_deferred_holds_a_signal_until_the_section_ends():
    """SIGINT inside the section is raised right after it, once; sent twice it is raised at
    once (the section is cut short); the previous handler is back in place afterwards."""
    before = signal.getsignal(signal.SIGINT)
    once = _make_held(signal.SIGINT, 1)
    assert once == ["section done", "KeyboardInterrupt"], f"one SIGINT: {once}"
    twice = _make_held(signal.SIGINT, 2)
    assert twice == ["KeyboardInterrupt"], f"two SIGINTs: {twice}"
    assert signal.getsignal(signal.SIGINT) is before, "the SIGINT handler was not restored"
