"""What the command-line tests of `freetoken-verify` share: running it in-process and the
bad-input contract (exit 2, one `error:` line, refused before any rank starts); a checkpoint
every rank fails to load is `conftest.make_broken_checkpoint`."""

from __future__ import annotations

import pytest

from freetoken_verify.cli import main


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `freetoken-verify ARGS`."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def assert_refused(capsys, args: list[str], *needles: str) -> None:
    """ARGS exit 2 with one `error:` line holding every needle, no traceback, before any
    rank starts."""
    code, out, err = run_cli(capsys, *args)
    assert code == 2, f"expected exit 2 for {args}, got {code}\n{out}{err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"one error line: {err!r}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} missing from {lines[0]!r}"
    assert "Traceback" not in out + err and "starting" not in err, "refused before ranks"


def failure_message(out: str, model: str, check: str, tp: int) -> str:
    """The full message of the failed (or errored) row `model check tp=N` from the FAILURES
    section after the table (the table's own message cell is shortened to the terminal)."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"--- {model} {check} tp={tp} ") and i + 1 < len(lines):
            return lines[i + 1]
    raise AssertionError(f"no FAILURES entry for {model} {check} tp={tp}:\n{out}")
