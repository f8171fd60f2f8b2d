"""Declarative shard plans: each model lists rules mapping checkpoint tensor names to a shard
spec and a destination (parameter name and slot inside it). Every checkpoint tensor must match
exactly one rule; after loading, every parameter element was written exactly once."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from freetoken.formats.shard import ShardError, ShardSpec
from freetoken.formats.specs import Replicate


@dataclass(frozen=True)
class Rule:
    """`pattern` (a full-match regex over checkpoint names) -> shard with `spec`, write to
    `param` (a `re` expansion template) at `slot` (indices into the parameter's leading dims:
    ints, slices, or names of regex groups holding an int). `param=None` ignores the tensor."""

    pattern: str
    spec: ShardSpec = field(default_factory=Replicate)
    param: str | None = r"\g<0>"
    slot: tuple = ()

    def destination(self, match: re.Match) -> tuple[str | None, tuple]:
        if self.param is None:
            return None, ()
        slot = tuple(int(match[s]) if isinstance(s, str) else s for s in self.slot)
        return _expand(match, self.param), slot


_GROUP = re.compile(r"\\g<(\w+)>")


@functools.cache
def _template(template: str) -> tuple[tuple[str, str | int | None], ...]:
    """`template` as (literal, group) pairs; only `\\g<name>` references (what plans use)
    are groups. Parsed once: `Match.expand` parses its template on every call, which costs
    more than the match itself over a checkpoint of 100k tensors."""
    parts, start = [], 0
    for ref in _GROUP.finditer(template):
        group = ref[1]
        parts.append((template[start:ref.start()], int(group) if group.isdigit() else group))
        start = ref.end()
    parts.append((template[start:], None))
    if "\\" in "".join(literal for literal, _ in parts):
        raise ValueError(f"shard plan template {template!r}: only \\g<name> escapes are "
                         "supported")
    return tuple(parts)


def _expand(match: re.Match, template: str) -> str:
    return "".join(literal + ("" if group is None else match[group])
                   for literal, group in _template(template))


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes on a rank."""

    name: str
    rule: Rule
    param: str | None
    slot: tuple


class ShardPlan:
    """An ordered set of rules for one model at one TP size."""

    def __init__(self, rules: list[Rule], tp_size: int):
        self.rules = rules
        self.tp_size = tp_size
        self._compiled = [(re.compile(r.pattern), r) for r in rules]

    def resolve(self, name: str) -> Target:
        """The one rule `name` matches, or a ShardError naming the tensor."""
        hits = [(m, r) for rx, r in self._compiled if (m := rx.fullmatch(name))]
        if not hits:
            raise ShardError(f"checkpoint tensor {name!r} matches no shard rule")
        if len(hits) > 1:
            pats = ", ".join(repr(r.pattern) for _, r in hits)
            raise ShardError(f"checkpoint tensor {name!r} matches {len(hits)} rules: {pats}")
        match, rule = hits[0]
        param, slot = rule.destination(match)
        return Target(name, rule, param, slot)

    def shard(self, name: str, full, rank: int):
        """Rank `rank`'s fresh, contiguous shard of checkpoint tensor `name`."""
        return self.resolve(name).rule.spec.shard(full, rank, self.tp_size, name)


def slot_key(slot: tuple) -> str:
    return repr(tuple((s.start, s.stop) if isinstance(s, slice) else s for s in slot))
