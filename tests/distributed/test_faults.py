"""Rank faults: the root failure is attributed to its rank with its own cause (not to a rank
torn down because of it), a rank that died while idle is named and the group restarted, a
hang names the hung rank and where it hangs, and SIGINT / SIGTERM stop every rank at once and
leave no process or temp directory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from freetoken.distributed import RankError, RankGroup, RankTimeout, choose_placement
from freetoken.distributed.comm import get_communicator
from freetoken_verify.checks.ranks import RankFailure, RankRunner

_SIGNAL_BOUND_S = 2.0


# --- functions run on ranks (module level: they are pickled to forkserver workers) ---------


def _rank_pid(ctx) -> int:
    return os.getpid()


def _rank_one_raises_while_zero_waits(ctx) -> None:
    if ctx.rank == 1:
        time.sleep(0.5)  # rank 0 is inside the all-reduce by now
        raise ValueError("layer 3 shard has 7 rows, expected 8")
    get_communicator().all_reduce(torch.ones(4))


def _rank_one_hangs_while_zero_waits(ctx) -> None:
    if ctx.rank == 1:
        time.sleep(600)
    get_communicator().all_reduce(torch.ones(4))


# --- helpers ---------------------------------------------------------------------------------


def _make_runner(tp_size: int, timeout: float = 120.0) -> RankRunner:
    return RankRunner(tp_size, choose_placement("cpu", tp_size), timeout)


def _assert_gone(pids: list[int], what: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    assert not alive, f"{what}: processes {alive} still alive"


def _assert_root(failure: RankFailure, rank: int, *needles: str) -> None:
    message = str(failure)
    assert message.startswith(f"rank {rank}"), f"root must be rank {rank}: {message!r}"
    for needle in needles:
        assert needle in message, f"{needle!r} missing from the message {message!r}"
    assert "torn down" not in message, f"a torn-down rank is not the cause: {message!r}"


# --- attribution -----------------------------------------------------------------------------


def test_root_failure_names_the_raising_rank_not_the_waiting_one():
    """Rank 1 raises while rank 0 waits in an all-reduce (and then fails on the lost peer):
    the failure names rank 1 with its exception type and message; rank 0 is 'torn down' only
    in the detail; the next call restarts the group."""
    with _make_runner(2) as runner:
        with pytest.raises(RankFailure) as info:
            runner.run(_rank_one_raises_while_zero_waits)
        _assert_root(info.value, 1, "ValueError", "layer 3 shard has 7 rows")
        assert "torn down after rank 1 failed" in info.value.detail(), info.value.detail()
        assert len(runner.run(_rank_pid)) == 2, "the group must restart for the next call"


def test_rank_killed_while_idle_is_named_and_the_group_restarts():
    """A rank SIGKILLed between calls: the next call fails naming that rank and the signal
    (no bare BrokenPipeError), and the call after it runs in a fresh group."""
    with _make_runner(2) as runner:
        pids = [r.value for r in runner.run(_rank_pid)]
        os.kill(pids[1], signal.SIGKILL)
        _assert_gone([pids[1]], "the killed rank")
        with pytest.raises(RankFailure) as info:
            runner.run(_rank_pid)
        _assert_root(info.value, 1, "killed by SIGKILL", "while idle")
        _assert_gone(pids, "the broken group")
        fresh = [r.value for r in runner.run(_rank_pid)]
        assert not set(fresh) & set(pids), f"expected new rank processes: {fresh} vs {pids}"


def test_hung_rank_is_named_with_the_function_and_line_where_it_hangs():
    """Rank 1 hangs while rank 0 waits for it in a collective: the timeout names rank 1 (not
    the waiting rank 0), the timeout and the innermost project frame, and every rank dies."""
    group = RankGroup(2, choose_placement("cpu", 2), timeout=120.0)
    group.start()
    try:
        pids = group.run(_rank_pid)
        with pytest.raises(RankTimeout) as info:
            group.run(_rank_one_hangs_while_zero_waits, timeout=3.0)
    finally:
        group.close(force=True)
    line = _rank_one_hangs_while_zero_waits.__code__.co_firstlineno + 2
    want = (f"rank 1 timed out after 3s in _rank_one_hangs_while_zero_waits at "
            f"tests/distributed/test_faults.py:{line}")
    assert str(info.value) == want, f"got {str(info.value)!r}, want {want!r}"
    _assert_gone(pids, "after the timeout")


def test_rank_error_summary_is_type_and_message():
    """RankError keeps type and first line of the message as its summary."""
    err = RankError(2, "Traceback ...\nKeyError: 'x'", "KeyError: 'x'")
    assert str(err) == "rank 2 failed: KeyError: 'x'", str(err)


# --- signals ---------------------------------------------------------------------------------


_HUNG_SCRIPT = """
import os, sys, threading, time
sys.path.insert(0, {test_dir!r})
from freetoken.distributed import RankGroup, choose_placement, stop_on_signals
from test_launch import _rank_pid, _rank_sleep_on
with stop_on_signals():
    group = RankGroup({tp}, choose_placement("cpu", {tp}), timeout=600)
    group.start()
    print(" ".join(str(p) for p in group.run(_rank_pid)), flush=True)
    group.run(_rank_sleep_on, tuple(range({tp})))
"""


def _make_hung_command(tmp_path: Path, tp: int) -> tuple[subprocess.Popen, list[int]]:
    script = textwrap.dedent(_HUNG_SCRIPT.format(test_dir=str(Path(__file__).parent), tp=tp))
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == tp, f"rank pids: {pids}\n{proc.stderr.read() if not pids else ''}"
    time.sleep(1.0)  # the ranks are inside the hung call now
    return proc, pids


@pytest.mark.parametrize("tp, signum, code", [(4, signal.SIGINT, 130),
                                              (2, signal.SIGTERM, 143)])
def test_signal_stops_hung_ranks_at_once_and_cleans_up(tmp_path, tp, signum, code):
    """SIGINT / SIGTERM with every rank hung: the command exits 130 / 143 within 2 s with one
    line on stderr, no rank survives and no temp directory (freetoken-ranks-*, pymp-*) stays."""
    proc, pids = _make_hung_command(tmp_path, tp)
    began = time.monotonic()
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    elapsed = time.monotonic() - began
    print(f"{signal.Signals(signum).name} at TP {tp}: exit after {elapsed:.2f}s")
    assert proc.returncode == code, f"exit {proc.returncode}, want {code}\n{err}"
    assert err.strip().splitlines() == [
        f"interrupted by {signal.Signals(signum).name}: rank processes stopped"], err
    assert elapsed < _SIGNAL_BOUND_S * 3, f"took {elapsed:.1f}s to stop {tp} hung ranks"
    _assert_gone(pids, "after the signal")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not left, f"temp directories left behind: {left}"
