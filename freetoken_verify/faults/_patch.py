"""The patches faults make again and again, written once, each through a real engine seam
where the engine has one: a step after loading (the loader's `POST_LOAD_HOOKS`), a family's
shard plan with some rules changed (its row of `ARCHITECTURES`), and a function called with
some of its arguments changed (a kernel launcher handed what a buggy caller would pass)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from freetoken.formats.shard import ShardSpec
from freetoken.loading import CheckpointReader, loader
from freetoken.loading.plan import Rule, ShardPlan
from freetoken.models import registry


def after_load(patch: Callable[[nn.Module, CheckpointReader, ShardPlan], None]) -> None:
    """Run `patch(model, reader, plan)` at the end of every later load in this process (every
    shard in place, the reader still open), leaving the parameters as a loader with the bug
    would."""
    loader.POST_LOAD_HOOKS.append(patch)


def checkpoint_name(names: list[str], suffix: str) -> str:
    """The checkpoint name ending in `suffix` (`layers.0.linear_attn.in_proj_z.weight`),
    whatever prefix the checkpoint puts before `layers`: what a patch reads from the
    reader's `names()`."""
    return next(n for n in names if n.endswith("." + suffix) or n == suffix)


def rewrite_plans(rewrite: Callable[[Rule], Rule], families: Iterable[str] | None = None
                  ) -> None:
    """Build the shard plan of every family in `families` (every registered one when None)
    with each of its rules passed through `rewrite`, by replacing the family's row of
    `ARCHITECTURES`."""
    for arch in list(registry.ARCHITECTURES if families is None else families):
        family = registry.ARCHITECTURES[arch]

        def plan(cfg, tp, original=family.plan):
            return ShardPlan([rewrite(r) for r in original(cfg, tp).rules], tp)

        registry.ARCHITECTURES[arch] = dataclasses.replace(family, plan=plan)


def respec(arch: str, needles: tuple[str, ...], make: Callable[[ShardSpec], ShardSpec]) -> None:
    """Give every `arch` plan rule whose pattern contains one of `needles` the spec
    `make(its spec)`, keeping destinations as they are."""

    def rewrite(rule: Rule) -> Rule:
        if any(n in rule.pattern for n in needles):
            return dataclasses.replace(rule, spec=make(rule.spec))
        return rule

    rewrite_plans(rewrite, (arch,))


def wrap_arguments(owner: Any, name: str, change: Callable[[dict], dict]) -> None:
    """Replace `owner.name` by a function that binds each call to the original's signature
    (defaults applied), replaces the arguments `change(arguments)` returns (name -> value) and
    calls the original with them: the callee computes exactly what a caller with the bug
    would have it compute. Wrapping a wrapper binds the original's signature."""
    original = getattr(owner, name)
    signature = inspect.signature(original)

    def wrapped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        bound.arguments.update(change(dict(bound.arguments)))
        return original(*bound.args, **bound.kwargs)

    wrapped.__wrapped__ = original
    setattr(owner, name, wrapped)
