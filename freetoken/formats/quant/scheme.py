"""A parsed quantization config: ordered module patterns, each giving a format, and the
modules excluded from quantization. Each producer matches module names its own way, and a
pattern keeps its producer's rule (`Pattern.style`):

- `modelopt`: exact names and fnmatch wildcards, each covering the module's children; names
  are compared with the multimodal `model.language_model.` prefix normalised to `model.`
  (ModelOpt writes either, TensorRT-LLM normalises the same way);
- `compressed-tensors`: an exact module name (children not included: its ignore lists are
  saved expanded, one entry per module), or `re:<regex>` matched from the start of the name
  (`re.match`, hence the recipes' `$` in `re:.*mlp.gate$`);
- `hf`: transformers' `should_convert_module`: the entry matched as a regex from the start up
  to a module boundary, or as a plain suffix of the name.

Exact names are kept in sets: an expanded ignore list has hundreds of entries and a 35B
checkpoint tens of thousands of expert modules.

An exclusion may also name a packed module by the fused name vLLM gives it (`PACKED`:
`linear_attn.in_proj_ba`, `in_proj_qkvz`, `self_attn.qkv_proj`, `mlp.gate_up_proj`; Qwen3-Next's
own checkpoints use the GatedDeltaNet ones): it excludes each module packed under that
name, as vLLM's `packed_modules_mapping` reads it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from freetoken.formats.quant.format import UNQUANTIZED, ModuleFormat

MODELOPT_STYLE, CT_STYLE, HF_STYLE = "modelopt", "compressed-tensors", "hf"
_MULTIMODAL = "model.language_model."
_WILDCARDS = re.compile(r"[*?\[]")
_HF_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"
_HF_REGEX = re.compile(r"[\\^$*+?{}\[\]|()]")
PACKED = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz",
          "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba",
          "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
"""A split module's last name -> the fused name packing it."""


def packed_name(module: str) -> str | None:
    """The fused name packing `module` (`...linear_attn.in_proj_b` -> `...in_proj_ba`), or
    None."""
    parent, _, last = module.rpartition(".")
    fused = PACKED.get(last)
    return f"{parent}.{fused}" if fused and parent else None


def packed_parts(name: str) -> list[str]:
    """The split modules a fused `name` packs (`...in_proj_ba` -> `...in_proj_b`,
    `...in_proj_a`); [] for a name that is not a fused one."""
    parent, _, last = name.rpartition(".")
    return [f"{parent}.{split}" for split, fused in PACKED.items() if fused == last and parent]


def _is_exact(entry: str, style: str) -> bool:
    """Whether `entry` names one module rather than a pattern, in `style`."""
    if style == CT_STYLE:
        return not entry.startswith("re:")
    if style == MODELOPT_STYLE:
        return not _WILDCARDS.search(entry)
    return not _HF_REGEX.search(entry)


def normalise(module: str) -> str:
    """`model.language_model.X` -> `model.X` (ModelOpt's two spellings of one module)."""
    return "model." + module[len(_MULTIMODAL):] if module.startswith(_MULTIMODAL) else module


def prefixes(module: str) -> list[str]:
    """`a.b.c` -> [`a.b.c`, `a.b`, `a`]: the module and its containers."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


@dataclass(frozen=True)
class Patterns:
    """A list of module entries of one producer style, split into exact names (a set) and
    patterns (wildcards, `re:`, or HF regex entries)."""

    style: str
    exact: frozenset[str] = frozenset()
    patterns: tuple[str, ...] = ()

    @classmethod
    def of(cls, entries, style: str) -> Patterns:
        exact, patterns = set(), []
        for entry in entries:
            if _is_exact(entry, style):
                exact.add(normalise(entry) if style == MODELOPT_STYLE else entry)
            else:
                patterns.append(entry)
        return cls(style, frozenset(exact), tuple(patterns))

    def names(self) -> frozenset[str]:
        """The entries that name one module (no wildcard, no regex)."""
        return self.exact

    def matches(self, module: str) -> bool:
        """Whether `module` is matched, by this producer's rule (see the module docstring)."""
        if self.style == CT_STYLE:
            return module in self.exact or any(
                re.match(p[3:], module) for p in self.patterns)
        if self.style == MODELOPT_STYLE:
            name = normalise(module)
            if any(p in self.exact for p in prefixes(name)):
                return True
            return any(fnmatchcase(n, p) or fnmatchcase(n, p + ".*")
                       for p in self.patterns for n in {module, name})
        if any(p in self.exact for p in prefixes(module)) or any(
                module[i:] in self.exact for i in range(len(module))):
            return True
        return any(re.match(rf"(?:{p}){_HF_BOUNDARY}", module) or module.endswith(p)
                   for p in self.patterns)



@dataclass(frozen=True)
class FormatRule:
    """Modules matching `patterns` are in `format`; `patterns` None matches every linear
    module (compressed-tensors' `Linear` target, a single-algorithm config)."""

    patterns: Patterns | None
    format: ModuleFormat

    def matches(self, module: str) -> bool:
        return self.patterns is None or self.patterns.matches(module)


@dataclass(frozen=True)
class QuantScheme:
    """Which format each module of a checkpoint is in. The first rule whose patterns match a
    linear module gives its format, unless `exclude` matches it first; a module no rule
    matches is unquantized. `source` names the config (file and key) for messages."""

    producer: str
    source: str
    rules: tuple[FormatRule, ...]
    exclude: Patterns
    entries: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    """(key, entry) of every config entry naming one module, for existence checks."""

    def format_of(self, module: str) -> ModuleFormat:
        """The format of linear module `module` (a checkpoint name, e.g.
        `model.layers.0.mlp.experts.3.gate_proj`)."""
        fused = packed_name(module)
        if self.exclude.matches(module) or (fused is not None and self.exclude.matches(fused)):
            return UNQUANTIZED
        for rule in self.rules:
            if rule.matches(module):
                return rule.format
        return UNQUANTIZED

    def is_quantized(self, module: str) -> bool:
        return self.format_of(module).quantized

    def formats(self) -> tuple[ModuleFormat, ...]:
        """Every format a rule can give, in rule order, without repeats."""
        return tuple(dict.fromkeys(r.format for r in self.rules))

    @property
    def global_scale_is_reciprocal(self) -> bool:
        """True when the checkpoint's NVFP4 global scales divide (compressed-tensors)."""
        return any(f.global_scale_is_reciprocal for f in self.formats())
