"""The fault list of docs/extending.md, generated from the registry: each fault under the module
that defines it, with its docstring's first sentence and where its catalogue entries say it
bites. `python -m freetoken_verify.faults --write` rewrites the list in the page;
`tests/verify/test_extending_doc.py` fails when the page's list is not this one."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from freetoken_verify.faults import REGISTRY
from freetoken_verify.faults.registry import Entry, Fault

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
BEGIN = ("<!-- The fault list, generated from the registry by "
         "`python -m freetoken_verify.faults --write`: edit the faults, not the list. -->")
END = "<!-- End of the generated fault list. -->"
_WIDTH = 100


def first_sentence(text: str | None) -> str:
    """A docstring's first sentence, on one line."""
    words = " ".join((text or "").split())
    end = words.find(". ")
    return words if end < 0 else words[: end + 1]


def where_caught(entry: Entry) -> str:
    """`caught by golden and shards on tiny-llama at TP 2, TP 1 green`: the entry's checks,
    case and TP sizes, and how it runs where that is not the default."""
    sizes = ", ".join(map(str, entry.tp))
    parts = [f"caught by {' and '.join(entry.checks)} on `{entry.model}` at TP {sizes}"]
    if entry.tp1_green and 1 not in entry.tp:
        parts.append("TP 1 green")
    if entry.dtype != "auto":
        parts.append(f"in {entry.dtype}")
    if entry.device != "cpu":
        parts.append(f"on {entry.device}")
    if entry.bitwise_only:
        parts.append("bitwise only")
    return ", ".join(parts)


def item(fault: Fault) -> str:
    """One fault's list item, wrapped at the page's width."""
    caught = "; ".join(where_caught(e) for e in fault.entries) or (
        f"not catalogued; proven by `{fault.proven_by}`")
    text = f"- `{fault.name}`: {first_sentence(fault.apply.__doc__)} ({caught})"
    return textwrap.fill(text, _WIDTH, subsequent_indent="  ", break_on_hyphens=False,
                         break_long_words=False)


def module_path(module: str) -> str:
    """`freetoken_verify.faults.memory` -> `freetoken_verify/faults/memory.py`."""
    return module.replace(".", "/") + ".py"


def markdown() -> str:
    """The whole list: a heading per module, in registry order, then its faults."""
    blocks, module = [], None
    for fault in REGISTRY:
        if fault.apply.__module__ != module:
            module = fault.apply.__module__
            blocks.append(f"`{module_path(module)}`:\n")
        blocks[-1] += "\n" + item(fault)
    return "\n\n".join(blocks) + "\n"


def page_list(text: str) -> str:
    """The generated list as the page holds it (between `BEGIN` and `END`)."""
    found = re.search(re.escape(BEGIN) + r"\n\n(.*?)\n" + re.escape(END), text, re.S)
    if found is None:
        raise ValueError(f"{PAGE}: no generated fault list (the markers {BEGIN!r} ... {END!r})")
    return found.group(1)


def write(page: Path = PAGE) -> bool:
    """Put the registry's list into `page`; whether the page changed."""
    text = page.read_text()
    old = page_list(text)
    new = markdown()
    if old == new:
        return False
    page.write_text(text.replace(f"{BEGIN}\n\n{old}\n{END}", f"{BEGIN}\n\n{new}\n{END}"))
    return True
