"""The launch-time probe for programmatic dependent launch (`freetoken.kernels.pdl.launch`): a
Triton without the `launch_pdl` option turns the first PDL launch into an ordinary one and
every later one too; one with it keeps PDL; other launch errors propagate."""

from __future__ import annotations

import pytest


class _FakeKernel:
    """Records launches; raises `error` for launches that pass `launch_pdl`."""

    def __init__(self, error: Exception | None):
        self.error, self.launches = error, []

    def __getitem__(self, grid):
        def launch(**kwargs):
            if "launch_pdl" in kwargs and self.error is not None:
                raise self.error
            self.launches.append(kwargs)
        return launch


def _make_probe(monkeypatch):
    from freetoken.kernels import pdl

    monkeypatch.setattr(pdl, "_SUPPORTED", {})
    return pdl


def test_pdl_probe_falls_back_once_and_remembers(monkeypatch):
    """A Triton that rejects `launch_pdl` (naming it): the launch runs without PDL, and later
    PDL launches go straight to ordinary ones (no second rejection)."""
    launcher = _make_probe(monkeypatch)
    kernel = _FakeKernel(KeyError("Keyword argument launch_pdl was specified but unrecognised"))
    launcher.launch(kernel, (1,), True, x=1)
    launcher.launch(kernel, (1,), True, x=2)
    assert kernel.launches == [{"x": 1}, {"x": 2}], kernel.launches
    assert launcher._SUPPORTED == {"supported": False}


def test_pdl_probe_keeps_pdl_where_triton_has_it(monkeypatch):
    """A Triton that takes `launch_pdl`: launches carry PDL=1 and launch_pdl, and the answer
    is remembered as supported."""
    launcher = _make_probe(monkeypatch)
    kernel = _FakeKernel(None)
    launcher.launch(kernel, (1,), True, x=1)
    launcher.launch(kernel, (1,), False, x=2)
    assert kernel.launches == [{"x": 1, "PDL": 1, "launch_pdl": True}, {"x": 2}]
    assert launcher._SUPPORTED == {"supported": True}


def test_pdl_probe_propagates_other_errors(monkeypatch):
    """An error that is not about `launch_pdl` is the kernel's, not the probe's: it is raised
    and nothing is remembered."""
    launcher = _make_probe(monkeypatch)
    kernel = _FakeKernel(TypeError("unexpected keyword argument 'stride_w_rows'"))
    with pytest.raises(TypeError, match="stride_w_rows"):
        launcher.launch(kernel, (1,), True, x=1)
    assert launcher._SUPPORTED == {}
