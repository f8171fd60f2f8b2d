"""Progress of a run: a line per step when stderr is a log, one updating line on a terminal,
erased when the step ends, even when it raises."""

from __future__ import annotations

import pytest
import torch
from transformers.utils import logging as hf_logging

from freetoken_verify.cases.catalogue import resolve_case
from freetoken_verify.checks import VerifyOptions
from freetoken_verify.reference.sources import hf_model
from freetoken_verify.running.progress import Progress


def _make_progress(live: bool, lines: list[str] | None = None) -> Progress:
    return Progress(say=None if lines is None else lines.append, live=live, interval=0.01)


def test_log_mode_prints_a_line_when_a_step_starts():
    """Not a terminal: `label ...` as a whole line when the step starts, then finished lines
    in order; no carriage returns."""
    lines: list[str] = []
    progress = _make_progress(False, lines)
    with progress.step("[tp=2] tiny-llama kernels"):
        progress.line("inside")
    progress.line("[1/1] done")
    assert lines == ["[tp=2] tiny-llama kernels ...", "inside", "[1/1] done"], lines


def test_live_mode_updates_one_line_and_erases_it(capsys):
    """A terminal: the step's label is rewritten in place with the seconds elapsed and erased
    when the step ends, also when it raises; nothing goes to stdout."""
    import time

    progress = _make_progress(True)
    with pytest.raises(RuntimeError), progress.step("[tp=1] tiny-llama golden"):
        time.sleep(0.05)
        raise RuntimeError("check crashed")
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\r\x1b[K[tp=1] tiny-llama golden ... ") >= 2, repr(err)
    assert err.endswith("\r\x1b[K"), f"the live line must be erased: {err[-40:]!r}"
    assert "\n" not in err, repr(err)


def test_hf_loading_prints_no_bar_of_its_own(capfd):
    """Loading HF's reference model draws none of HF's `Loading weights` bars (they came out
    through `freetoken_verify.run(progress=False)` and in CI logs); HF's own setting is
    restored afterwards."""
    hf_model(resolve_case("tiny-llama"), VerifyOptions(), torch.float32, "cpu")
    err = capfd.readouterr().err
    assert "Loading weights" not in err, err[-500:]
    assert hf_logging.is_progress_bar_enabled(), "HF's own progress setting not restored"
