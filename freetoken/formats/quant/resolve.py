"""Every engine module's format, resolved from a `QuantScheme` against a model's module
table. Checkpoints name HF's modules (`q_proj`, `in_proj_qkv`, `in_proj_b`, per-expert
`experts.3.gate_proj`); the engine fuses several into one destination (`qkv_proj`, the GDN
`in_proj`, stacked experts). A destination whose parts differ in format is split into GEMMs
that each have one format where the model allows it (`Destination.splittable`), else
refused; so is a config entry naming a module the model does not have, and a format a module
cannot take. Messages name the module and the config. An exclusion may name a packed
module by its fused vLLM name (`freetoken.formats.quant.scheme.PACKED`)."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.formats.quant.format import BF16, ModuleFormat, QuantConfigError
from freetoken.formats.quant.scheme import (
    CT_STYLE,
    HF_STYLE,
    MODELOPT_STYLE,
    QuantScheme,
    normalise,
    packed_parts,
    prefixes,
)

FOREIGN = ("model.visual", "mtp", "visual")
"""Modules of a checkpoint the engine does not run (vision tower, multi-token prediction):
a config may name them, their formats are never asked."""


@dataclass(frozen=True)
class Destination:
    """An engine module `name` filled from the checkpoint's linear modules `parts` (in row
    order). `accepts`: the format kinds the engine computes it in (bf16 always).
    `splittable`: parts of different formats may become separate GEMMs; else refused.
    `stacked`: the parts are one stacked set (routed experts) that must share a format.
    `bf16_only`: parts no quantized format fits, whatever `accepts` says; `note` says why,
    for the message."""

    name: str
    parts: tuple[str, ...]
    accepts: frozenset[str] = frozenset({BF16})
    splittable: bool = False
    stacked: bool = False
    bf16_only: tuple[str, ...] = ()
    note: str = ""

    def accepted(self, part: str) -> frozenset[str]:
        """The format kinds `part` may be stored in."""
        return frozenset({BF16}) if part in self.bf16_only else self.accepts | {BF16}


@dataclass(frozen=True)
class Gemm:
    """One GEMM of a destination: consecutive `parts` stored in one `format`."""

    parts: tuple[str, ...]
    format: ModuleFormat


@dataclass(frozen=True)
class ModuleTable:
    """A model's modules as a checkpoint names them: the linear destinations, and the other
    modules a config may name (norms, conv1d, embeddings, the `linear_attn` container...)."""

    destinations: tuple[Destination, ...]
    others: tuple[str, ...] = ()

    def known(self) -> set[str]:
        """Every module name of the model, containers included."""
        names = [p for d in self.destinations for p in d.parts] + list(self.others)
        return {prefix for n in names for prefix in prefixes(n)}


def resolve(scheme: QuantScheme | None, table: ModuleTable) -> dict[str, tuple[Gemm, ...]]:
    """Destination name -> its GEMMs (one for a destination whose parts share a format).
    QuantConfigError naming the module for a config entry the model has no module for, a
    stacked set or unsplittable destination whose parts differ, or a refused format."""
    if scheme is not None:
        _check_entries(scheme, table)
    return {d.name: _gemms(scheme, d) for d in table.destinations}


def _check_entries(scheme: QuantScheme, table: ModuleTable) -> None:
    known = table.known()
    style = scheme.exclude.style
    if style == MODELOPT_STYLE:
        known = known | {normalise(k) for k in known}
    for key, entry in scheme.entries:
        # A fused name (`in_proj_ba`) names the model's modules it packs (scheme.PACKED).
        names = [entry] + packed_parts(entry)
        if any(n in known for n in names) or _foreign(entry):
            continue
        if style == HF_STYLE and any(k.endswith(n) for k in known for n in names):
            continue
        what = "modules" if style != CT_STYLE else "module names"
        raise QuantConfigError(f"{scheme.source}: {key} names {entry!r}, which is none of the "
                               f"model's {what} (a config for another model, or a typo)")


def _foreign(entry: str) -> bool:
    name = normalise(entry)
    return any(n == f or n.startswith(f + ".") for f in FOREIGN
               for n in (entry, name, name.removeprefix("model.")))


def _gemms(scheme: QuantScheme | None, dest: Destination) -> tuple[Gemm, ...]:
    formats = [scheme.format_of(p) if scheme is not None else ModuleFormat()
               for p in dest.parts]
    runs: list[tuple[list[str], ModuleFormat]] = []
    for part, fmt in zip(dest.parts, formats):
        if runs and runs[-1][1] == fmt:
            runs[-1][0].append(part)
        else:
            runs.append(([part], fmt))
    if len(runs) > 1 and not dest.splittable:
        (a, fa), (b, fb) = runs[0], runs[1]
        kind = "the stacked modules of" if dest.stacked else "the fused parts of"
        source = scheme.source if scheme is not None else "the config"
        raise QuantConfigError(f"{source}: {kind} {dest.name} differ in format: {a[-1]} is "
                               f"{fa.describe()}, {b[0]} is {fb.describe()}; FreeToken needs "
                               "them in one format")
    for part, fmt in zip(dest.parts, formats):
        if fmt.kind not in dest.accepted(part):
            accepted = ", ".join(sorted(dest.accepted(part)))
            # The note says why a part takes no quantized format at all.
            explained = part in dest.bf16_only or dest.accepts <= {BF16}
            note = f" ({dest.note})" if dest.note and explained else ""
            raise QuantConfigError(f"{scheme.source}: {part} is {fmt.describe()}, which "
                                   f"FreeToken does not support for {dest.name}{note}; it "
                                   f"runs it as: {accepted}")
    return tuple(Gemm(tuple(parts), fmt) for parts, fmt in runs)
