"""`freetoken-verify --list`: the bundled cases, the checks and the injectable faults, each
with a one-line description."""

from __future__ import annotations

import json
from collections.abc import Callable

from freetoken_verify.cases.catalogue import CASES, GOLDEN
from freetoken_verify.checks.base import CHECKS
from freetoken_verify.faults import FAULTS

# Descriptions longer than this are cut at a word boundary: a listing line, not the docstring.
_WIDTH = 100


def _first_sentence(text: str | None) -> str:
    """The first sentence of a docstring, on one line of at most `_WIDTH` characters."""
    words = " ".join((text or "").split())
    end = words.find(". ")
    sentence = words if end < 0 else words[: end + 1]
    if len(sentence) <= _WIDTH:
        return sentence
    return sentence[: _WIDTH - 3].rsplit(" ", 1)[0].rstrip(",:;") + "..."


def case_description(name: str) -> str:
    """Architecture and dimensions of a bundled case, from its config.json."""

    path = GOLDEN / name / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"unavailable ({type(e).__name__}: {path}); run `make golden`"
    text = config.get("text_config", config)
    parts = [config.get("model_type", "?"), f"{text.get('num_hidden_layers')} layers",
             f"hidden {text.get('hidden_size')}",
             f"{text.get('num_attention_heads')} heads / {text.get('num_key_value_heads')} KV"]
    if "linear_num_value_heads" in text:
        parts.append("GatedDeltaNet + gated attention")
    if "num_experts" in text:
        parts.append(f"{text['num_experts']} experts top-{text.get('num_experts_per_tok')}")
    if CASES[name].quantized:
        parts.append(CASES[name].quantization_label)
    return ", ".join(parts)


def listing() -> dict[str, list[tuple[str, str]]]:
    """Section title -> (name, description) rows: bundled cases, checks in run order,
    faults."""

    return {"bundled cases": [(n, case_description(n)) for n in sorted(CASES)],
            "checks (in run order)": [(c.name, c.description) for c in CHECKS],
            "faults (--fault)": [(n, _first_sentence(f.__doc__)) for n, f in FAULTS.items()]}


def print_listing(echo: Callable[[str], None]) -> None:
    """Print every section as aligned `name  description` lines."""
    for i, (title, rows) in enumerate(listing().items()):
        width = max(len(name) for name, _ in rows)
        echo(("\n" if i else "") + f"{title}:")
        for name, description in rows:
            echo(f"  {name:<{width}}  {description}")
