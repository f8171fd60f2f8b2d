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
    ints, slices, or names of regex groups holding an int). `param=None` drops the tensor,
    after the checks of `checked` when it is given (a stored scale the engine does not use is
    still refused when it could not be one: `ScalarScale`'s finite and above 0)."""

    pattern: str
    spec: ShardSpec = field(default_factory=Replicate)
    param: str | None = r"\g<0>"
    slot: tuple = ()
    checked: ShardSpec | None = None

    def __post_init__(self):
        if self.checked is not None and self.param is not None:
            raise ValueError(f"shard rule {self.pattern!r}: `checked` is for a tensor it "
                             f"drops, but it loads it into {self.param!r} (its spec checks it)")

    def check_dropped(self, full, rank: int, size: int, name: str) -> None:
        """Run `checked`'s checks on checkpoint tensor `name`, which this rule drops (a
        ShardError naming it); nothing for a rule without one."""
        if self.checked is not None:
            self.checked.pieces(full, rank, size, name)

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


_NAMED_GROUP = re.compile(r"\(\?P<\w+>")


@functools.lru_cache(maxsize=256)
def _alternation(patterns: tuple[str, ...]) -> re.Pattern | None:
    """One regex trying `patterns` in order, alternative i in a group named `_i` (their own
    named groups made plain, since two alternatives may use one name); None where a pattern
    cannot be an alternative (a back-reference, an inline flag) or there is none. Cached:
    every load of a model at a TP size builds the same plan, and compiling its alternations
    (one per rule index, long patterns beyond `re`'s own cache) took 0.1-0.4 s per load of a
    tiny Qwen3.5-MoE on the 2-core CI machine, against 2-15 ms with the cache."""
    if not patterns:
        return None
    if any("(?P=" in p or re.search(r"\\\d|\(\?[aiLmsux]", p) for p in patterns):
        return None
    body = "|".join(f"(?P<_{i}>{_NAMED_GROUP.sub('(?:', p)})" for i, p in enumerate(patterns))
    try:
        return re.compile(body)
    except re.error:
        return None


class ShardPlan:
    """An ordered set of rules for one model at one TP size."""

    def __init__(self, rules: list[Rule], tp_size: int):
        self.rules = rules
        self.tp_size = tp_size
        self._compiled = [(re.compile(r.pattern), r) for r in rules]
        # Resolving a name tries every rule; a checkpoint has 10^3-10^5 names. One combined
        # regex finds the first rule that matches, and one over the rules after it proves no
        # other does (the engine tried the ones before it and they failed), both in C.
        self._first = _alternation(tuple(r.pattern for r in rules))
        self._after: dict[int, re.Pattern | None] = {}

    def resolve(self, name: str) -> Target:
        """The one rule `name` matches, or a ShardError naming the tensor."""
        index = self._fast_index(name)
        if index is None:
            return self._resolve_slow(name)
        regex, rule = self._compiled[index]
        param, slot = rule.destination(regex.fullmatch(name))
        return Target(name, rule, param, slot)

    def _fast_index(self, name: str) -> int | None:
        """The index of the one rule `name` matches; None where the combined regexes cannot
        tell (none or several match, or the plan's patterns cannot be combined)."""
        if self._first is None or (hit := self._first.fullmatch(name)) is None:
            return None
        index = int(hit.lastgroup[1:])
        if index not in self._after:
            after = _alternation(tuple(r.pattern for r in self.rules[index + 1:]))
            self._after[index] = after
            if after is None and index + 1 < len(self.rules):
                self._first = None  # these patterns do not combine: resolve one by one
                return None
        after = self._after[index]
        return None if after is not None and after.fullmatch(name) else index

    def _resolve_slow(self, name: str) -> Target:
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
