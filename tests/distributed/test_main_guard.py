"""A script that starts ranks at its top level, without the `if __name__ == "__main__":`
guard, fails in the parent with one MainModuleError line that names the script and the
guard (not multiprocessing's bootstrapping traceback from every rank, nor "rank 1 failed:
process died"); a rank that dies while importing the main module is named as such. Nothing
is left running or in TMPDIR."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import GOLDEN, short_tmpdir

_GUARD = 'if __name__ == "__main__":'
_UNGUARDED = {
    "rank-group": """
        from freetoken.distributed import RankGroup, choose_placement
        group = RankGroup(2, choose_placement("cpu", 2), timeout=120)
        group.start()
        print("started", flush=True)
        group.close()
    """,
    "llm": """
        from freetoken import LLM
        llm = LLM({model!r}, tp=2, device="cpu")
        print("started", flush=True)
        llm.shutdown()
    """,
}
_FAILS_IN_RANKS = """
    if __name__ != "__main__":
        raise RuntimeError("settings.toml not found")  # only a rank's import gets here
    from freetoken.distributed import RankGroup, choose_placement
    if __name__ == "__main__":
        with RankGroup(2, choose_placement("cpu", 2), timeout=120):
            print("started", flush=True)
"""


def _make_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(body))
    return script


def _run(tmp_path: Path, script: Path) -> subprocess.CompletedProcess:
    tmpdir = short_tmpdir(tmp_path)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, TMPDIR=str(tmpdir)))


def _processes_using(tmpdir: Path) -> list[int]:
    """Processes of ours (ranks, fork servers) whose environment points TMPDIR at `tmpdir`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("TMPDIR") == str(tmpdir) and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def _assert_nothing_left(tmp_path: Path) -> None:
    tmpdir = short_tmpdir(tmp_path)
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline and (_processes_using(tmpdir) or any(tmpdir.iterdir())):
        time.sleep(0.2)
    left = _processes_using(tmpdir)
    for pid in left:
        psutil.Process(pid).kill()
    assert not left, f"processes left running: {left}"
    assert not list(tmpdir.iterdir()), f"left in TMPDIR: {sorted(tmpdir.iterdir())}"
    tmpdir.rmdir()


def _assert_one_error(run: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 1, nothing started, and a MainModuleError as the last line; returns that line."""
    lines = run.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    assert run.returncode == 1, f"exit {run.returncode}\n{run.stderr}"
    assert "started" not in run.stdout, f"the script went on: {run.stdout!r}"
    assert last.startswith("freetoken.distributed.bootstrap.MainModuleError: "), \
        f"last line is not a MainModuleError: {last!r}\n{run.stderr}"
    for needle in needles:
        assert needle in last, f"{needle!r} missing from {last!r}"
    return last


@pytest.mark.parametrize("kind", sorted(_UNGUARDED))
def test_ranks_started_at_import_time_are_one_error_naming_the_guard(tmp_path, kind):
    """An unguarded script (RankGroup, or the README's `LLM(..., tp=2)`): one error line
    naming the script and the guard; no rank printed multiprocessing's bootstrapping
    traceback (the parent's own traceback is the only one)."""
    script = _make_script(tmp_path, _UNGUARDED[kind].format(model=str(GOLDEN / "tiny-llama")))
    run = _run(tmp_path, script)
    _assert_one_error(run, str(script), "every rank imports it again", _GUARD)
    assert "bootstrapping phase" not in run.stderr, f"a rank's traceback:\n{run.stderr}"
    assert run.stderr.count("Traceback") == 1, f"more than the parent's:\n{run.stderr}"
    assert "process died" not in run.stderr, run.stderr
    _assert_nothing_left(tmp_path)


def test_rank_dying_while_importing_the_main_module_is_named(tmp_path):
    """A guarded script whose top level fails when a rank imports it: the error says the
    rank died while importing the main module, names the script and the guard."""
    script = _make_script(tmp_path, _FAILS_IN_RANKS)
    run = _run(tmp_path, script)
    _assert_one_error(run, "died (exit code 1) while importing the main module",
                      str(script), _GUARD)
    assert "settings.toml not found" in run.stderr, f"the rank's own error:\n{run.stderr}"
    _assert_nothing_left(tmp_path)
