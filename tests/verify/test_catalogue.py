"""Every entry of the TP bug catalogue (`freetoken_verify.faults.catalogue.CATALOGUE`): injected
into its
bundled case, it fails a row naming the module, tensor or rank at every TP size where it
bites, and TP=1 stays green where the bug is TP-only. A harness that goes green, or red
without saying where, on any of them has regressed."""

from __future__ import annotations

import pytest
import torch

from freetoken_verify.faults import FAULTS
from freetoken_verify.faults.catalogue import CATALOGUE
from freetoken_verify.running.catalogue_run import run_entry, run_rows

# Marked slow (`make test-slow`): entries with a TP-4 group (a 4-rank spawn, ~9 s on two
# cores each) and the kernel faults, whose kernel matrix in Triton's interpreter takes a
# minute each and which tests/kernels/test_kernels_check.py already proves in `make test`.
_SLOW = {e.fault for e in CATALOGUE if max(e.tp) >= 4 or "kernels" in e.checks}


def test_catalogue_is_large_and_every_fault_injectable():
    """At least 25 bug classes, each a registered fault, each with its own words."""
    assert len(CATALOGUE) >= 25, len(CATALOGUE)
    assert all(e.fault in FAULTS for e in CATALOGUE)
    assert len({e.fault for e in CATALOGUE}) == len(CATALOGUE)


def _marks(entry) -> list:
    marks = [pytest.mark.slow] if entry.fault in _SLOW else []
    if entry.device == "cuda":
        marks += [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                      reason="needs a CUDA GPU")]
    return marks


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.fault, marks=_marks(e))
                                   for e in CATALOGUE])
def test_bug_is_caught_and_named(entry):
    verdict = run_entry(entry, timeout=240.0)
    assert not verdict.problems, (
        f"{entry.bug_class} ({entry.fault}) on {entry.model}: " + "; ".join(verdict.problems))


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.fault) for e in CATALOGUE
                                   if e.bitwise_only])
def test_bitwise_only_entries_pass_the_tolerance_comparison(entry):
    """What `bitwise_only` claims (docs/verification.md's column): the entry's own run with
    `--no-bitwise` is green at every TP size, so only the bitwise comparison catches it."""
    rows = run_rows(entry, timeout=240.0, bitwise=False)
    caught = [f"tp={r.tp} {r.check} {r.status}: {r.message}" for r in rows
              if r.status in ("fail", "error")]
    assert rows and not caught, f"{entry.fault}: the tolerance comparison catches it: {caught}"
