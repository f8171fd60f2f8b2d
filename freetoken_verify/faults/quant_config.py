"""Wrong readings of a quantization config, for `--fault` (registered in
`freetoken_verify.faults.FAULTS`): the resolver bugs other engines shipped when a config names
HF's split modules (vLLM #40252, SGLang #22287: a split-name ignore list not mapped onto the
fused module; vLLM #36242: in_proj_b / in_proj_a handled as in_proj_qkv). Each patches
`QuantScheme.format_of` in the process it runs in (the ranks), so the parent's own reading of
the config, which the harness's statements come from, stays right."""

from __future__ import annotations

import re

from freetoken.formats.quant.scheme import QuantScheme
from freetoken_verify.faults.registry import Entry, fault

_FUSED = ((re.compile(r"\.in_proj_(qkv|z|b|a)$"), ".in_proj"),
          (re.compile(r"\.[qkv]_proj$"), ".qkv_proj"),
          (re.compile(r"\.(gate|up)_proj$"), ".gate_up_proj"))


@fault("ignore-split-names-unmapped",
       Entry("a split-name ignore list not mapped onto the fused module",
             "tiny-qwen3.5-moe-nvfp4-ct", (1, 2), ("golden", "shards"), r"linear_attn\.in_proj",
             tp1_green=False))
def ignore_split_names_unmapped() -> None:
    """Exclusion (ignore / exclude / modules_to_not_convert) entries are matched against the
    engine's fused module name instead of each HF split name: an ignore list naming
    `linear_attn.in_proj_qkv` no longer keeps it unquantized, so a bf16 module is read as
    quantized."""
    original = QuantScheme.format_of

    def format_of(self, module):
        fused = module
        for pattern, name in _FUSED:
            fused = pattern.sub(name, fused)
        if fused != module and not self.exclude.matches(fused):
            for rule in self.rules:
                if rule.matches(module):
                    return rule.format
        return original(self, module)

    QuantScheme.format_of = format_of


@fault("gdn-ba-takes-qkv-format",
       Entry("GatedDeltaNet in_proj_b / in_proj_a given in_proj_qkv's quantized format",
             "tiny-qwen3.5-moe-fp8", (1, 2), ("golden",), r"in_proj_[ba]", tp1_green=False))
def gdn_ba_takes_qkv_format() -> None:
    """GatedDeltaNet's in_proj_b and in_proj_a given in_proj_qkv's format (the fused
    `in_proj_ba` handled as part of the quantized in_proj): per-head rows read as quantized."""
    original = QuantScheme.format_of

    def format_of(self, module):
        if re.search(r"\.in_proj_[ba]$", module):
            return original(self, re.sub(r"\.in_proj_[ba]$", ".in_proj_qkv", module))
        return original(self, module)

    QuantScheme.format_of = format_of
