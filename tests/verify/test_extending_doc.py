"""docs/extending.md documents every injectable fault, under the module that defines it: a
fault added without its line there (or moved without updating it) fails here."""

from __future__ import annotations

import re
from pathlib import Path

from verify.faults import FAULTS

_DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def _documented() -> dict[str, str]:
    """Fault name -> the module heading (`verify/x.py`) it is listed under."""
    text = _DOC.read_text()
    found, module = {}, None
    for line in text.splitlines():
        heading = re.fullmatch(r"`(verify/\w+\.py)`:", line.strip())
        if heading:
            module = heading.group(1)
        item = re.match(r"- `([\w-]+)`: \S", line)
        if item and module:
            found[item.group(1)] = module
    return found


def test_every_fault_is_documented_under_its_module():
    documented = _documented()
    for name, fault in FAULTS.items():
        module = "verify/" + fault.__module__.rsplit(".", 1)[-1] + ".py"
        assert documented.get(name) == module, (
            f"{name} ({module}) is not listed under `{module}`: in docs/extending.md")
    assert set(documented) == set(FAULTS), f"unknown: {sorted(set(documented) - set(FAULTS))}"
