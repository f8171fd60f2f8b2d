"""The fault registry (`freetoken_verify/faults/registry.py`) and the shared patches
(`freetoken_verify/faults/_patch.py`): `@fault` gives each entry its fault's name and refuses a
fault registered twice, one with no docstring (the `--list` line), one neither catalogued nor
proven elsewhere, and one carrying another fault's entry; `FAULTS` and `CATALOGUE` are its
views. `wrap_arguments` hands the original what the change says, defaults included, and a
second wrapper binds the original's signature."""

from __future__ import annotations

import types

import pytest

from freetoken_verify.faults import FAULTS, REGISTRY, registry
from freetoken_verify.faults._patch import wrap_arguments
from freetoken_verify.faults.catalogue import CATALOGUE
from freetoken_verify.faults.registry import Entry, fault

ENTRY = Entry("a bug", "tiny-llama", (2,), ("golden",), r"words")


@pytest.fixture
def empty(monkeypatch):
    """A registry of its own for the test (the real one stays as loaded)."""
    monkeypatch.setattr(registry, "REGISTERED", {})
    return registry


def _documented():
    """A fault."""


def test_entries_take_their_faults_name(empty):
    fault("some-bug", ENTRY, ENTRY)(_documented)
    assert [e.fault for e in empty.REGISTERED["some-bug"].entries] == ["some-bug", "some-bug"]
    assert empty.REGISTERED["some-bug"].apply is _documented


@pytest.mark.parametrize("register, words", [
    (lambda: [fault("x", ENTRY)(_documented), fault("x", ENTRY)(_documented)],
     "registered twice"),
    (lambda: fault("x", ENTRY)(lambda: None), "has no docstring"),
    (lambda: fault("x")(_documented), "has no catalogue entry"),
    (lambda: fault("x", Entry("b", "tiny-llama", (2,), ("golden",), "w", fault="y"))(
        _documented), "carries entries of ['y']"),
])
def test_a_bad_registration_is_refused_naming_the_fault(empty, register, words):
    with pytest.raises(ValueError, match="fault 'x'") as refused:
        register()
    assert words in str(refused.value)


def test_faults_and_catalogue_are_views_of_the_registry():
    assert list(FAULTS) == [f.name for f in REGISTRY]
    assert CATALOGUE == tuple(e for f in REGISTRY for e in f.entries)
    assert all(f.entries or f.proven_by for f in REGISTRY)


def test_wrap_arguments_changes_only_what_it_returns():
    calls = []
    owner = types.SimpleNamespace(launch=lambda x, table, stride=1: calls.append(
        (x, table, stride)))
    wrap_arguments(owner, "launch", lambda a: {"stride": a["stride"] - 1})
    wrap_arguments(owner, "launch", lambda a: {"table": a["table"] * 10})
    owner.launch(1, 2)
    owner.launch(1, table=3, stride=5)
    assert calls == [(1, 20, 0), (1, 30, 4)]
