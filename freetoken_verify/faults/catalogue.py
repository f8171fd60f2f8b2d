"""The TP bug catalogue: the catalogue entries of every injectable fault
(`freetoken_verify.faults.FAULTS`), each written beside its fault (`@fault`), with the bundled
case and TP sizes where it bites, the checks that must catch it and the words its failing row
must contain. `tests/verify/test_catalogue.py` proves each entry; `python -m
freetoken_verify.running.catalogue_run` prints the verdicts."""

from __future__ import annotations

from freetoken_verify.faults import REGISTRY
from freetoken_verify.faults.registry import Entry

CATALOGUE: tuple[Entry, ...] = tuple(e for f in REGISTRY for e in f.entries)
"""Every catalogue entry, in the faults' order."""

__all__ = ["CATALOGUE", "Entry"]
