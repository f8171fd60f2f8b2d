"""Ctrl-C on `freetoken-verify` while its ranks work: exit 130 with the interruption as the
last line (no traceback), every rank gone, no temp directory left in TMPDIR."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil


def _make_run(tmp_path) -> subprocess.Popen:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.Popen([sys.executable, "-m", "freetoken_verify.cli", "--model", "tiny-llama",
                             # kernels runs its matrix for tens of seconds: the signal lands
                             # while the ranks work, however fast the machine.
                             "--tp", "2", "--checks", "golden,kernels"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_ranks(proc: subprocess.Popen) -> list[int]:
    for line in proc.stderr:
        if "starting" in line:
            break
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)
                 if c.name().startswith("python") or "rank" in c.name()]
        if len(ranks) >= 3:  # the fork server and two ranks
            return ranks
        time.sleep(0.2)
    raise AssertionError("the ranks never started")


def test_sigint_during_a_run_exits_130_and_cleans_up(tmp_path):
    """SIGINT while the rank group runs: exit 130, last stderr line says so, all gone."""
    proc = _make_run(tmp_path)
    try:
        children = _wait_for_ranks(proc)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, f"exit {proc.returncode}\n{err}"
    assert err.strip().splitlines()[-1] == "interrupted by SIGINT: rank processes stopped", err
    assert "Traceback" not in err, err
    time.sleep(1.0)
    alive = [p for p in children if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {alive}"
    assert not list(tmp_path.iterdir()), f"left in TMPDIR: {list(tmp_path.iterdir())}"
