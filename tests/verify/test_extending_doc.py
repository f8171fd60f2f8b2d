"""docs/extending.md is true of the code: its fault list is the one the registry generates
(`python -m freetoken_verify.faults --write`), documenting every injectable fault under the
module that defines it, every file it names exists, and every name it places in a file (`NAME`
(`path.py`), or `NAME` of `path.py`) is defined there. A fault added without regenerating the
list, a module moved, or an instruction naming a table that does not exist (a registry the
checks no longer have) fails here."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from freetoken_verify.faults import FAULTS, doc

ROOT = Path(__file__).resolve().parents[2]
_DOC = ROOT / "docs" / "extending.md"
# A source file named in the page; `NAME` stands for the one a reader creates.
_PATH = re.compile(r"`((?:freetoken|freetoken_verify|tests|bench)/[\w/.]*?\.py)`")
# `NAME` (`path.py`) / `NAME` (`path.py`; ...) / `NAME` of `path.py`, NAME an identifier.
_PLACED = re.compile(r"`([A-Za-z_][\w]*)(?:\(\))?` (?:\(|of )`((?:freetoken|freetoken_verify)/"
                     r"[\w/]+\.py)`")


def _source_path(module: str) -> str:
    """The repository path of an importable module (`freetoken_verify.faults` -> its
    `__init__.py`)."""
    return str(Path(importlib.util.find_spec(module).origin).relative_to(ROOT))


def _defined_names(path: Path) -> set[str]:
    """Top-level names a module defines: functions, classes, assignments and imports."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _named_files(text: str) -> list[str]:
    return sorted({p for p in _PATH.findall(text) if "NAME" not in p})


def _placed_names(text: str) -> list[tuple[str, str]]:
    return sorted(set(_PLACED.findall(" ".join(text.split()))))


def _documented() -> dict[str, str]:
    """Fault name -> the module heading (`freetoken_verify/faults/x.py`) it is listed under."""
    text = _DOC.read_text()
    found, module = {}, None
    for line in text.splitlines():
        heading = re.fullmatch(r"`(freetoken_verify/[\w/]+\.py)`:", line.strip())
        if heading:
            module = heading.group(1)
        item = re.match(r"- `([\w-]+)`: \S", line)
        if item and module:
            found[item.group(1)] = module
    return found


def test_the_fault_list_is_the_registrys():
    """The page's list is what the registry generates now: a fault added, renamed, moved or
    re-catalogued without `python -m freetoken_verify.faults --write` fails here."""
    assert doc.page_list(_DOC.read_text()) == doc.markdown(), (
        "docs/extending.md's fault list is stale: run `python -m freetoken_verify.faults "
        "--write`")


def test_every_fault_is_documented_under_its_module():
    documented = _documented()
    for name, fault in FAULTS.items():
        module = _source_path(fault.__module__)
        assert documented.get(name) == module, (
            f"{name} ({module}) is not listed under `{module}`: in docs/extending.md")
    assert set(documented) == set(FAULTS), f"unknown: {sorted(set(documented) - set(FAULTS))}"


def test_every_named_file_exists():
    """Each source path the page gives (other than the reader's own `NAME`) is a file."""
    missing = [p for p in _named_files(_DOC.read_text()) if not (ROOT / p).is_file()]
    assert not missing, f"docs/extending.md names files that do not exist: {missing}"


@pytest.mark.parametrize("name,path", _placed_names(_DOC.read_text()))
def test_every_placed_name_is_defined_there(name, path):
    """A name the page places in a module (a table, a function, a class) is defined in it."""
    assert name in _defined_names(ROOT / path), (
        f"docs/extending.md says `{name}` is in `{path}`, which does not define it")


def test_a_stale_instruction_is_caught(tmp_path):
    """The registry drift this test exists for (a table named in the wrong module, or one that
    no longer exists) is found; a true instruction is not."""
    stale = "register it in `ALL_CHECK_NAMES` (`freetoken_verify/checks/base.py`)"
    true = "add a `CheckSpec` to `CHECKS` (`freetoken_verify/checks/base.py`)"
    defined = _defined_names(ROOT / "freetoken_verify/checks/base.py")
    assert [n for n, _ in _placed_names(stale) if n not in defined] == ["ALL_CHECK_NAMES"]
    assert [n for n, _ in _placed_names(true) if n not in defined] == []
    assert _named_files("see `freetoken_verify/no_such.py`") == ["freetoken_verify/no_such.py"]
