"""The architecture table: one entry per model family, naming the HF architectures and model
types it serves, its config parser, model class, shard plan and TP check. Adding a family
touches this table plus the family's own files."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from freetoken.config import ConfigError, ModelConfig, decoder_config, parse_config, read_hf_config
from freetoken.distributed import get_tp_info
from freetoken.layers.invariant import CanonicalReductions, canonical_reductions
from freetoken.loading.plan import ShardPlan
from freetoken.models.decoder_modules import decoder_module_table
from freetoken.models.llama import LlamaForCausalLM
from freetoken.models.qwen3 import Qwen3ForCausalLM
from freetoken.models.qwen3_5_moe.config import qwen3_5_moe_config
from freetoken.models.qwen3_5_moe.model import Qwen35MoeForCausalLM
from freetoken.models.qwen3_5_moe.plan import check_qwen3_5_moe_tp, qwen3_5_moe_plan
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM
from freetoken.models.shard_rules import check_decoder_tp, decoder_plan


@dataclass(frozen=True)
class Architecture:
    """One model family: how its config is parsed, its model built, its checkpoint split."""

    name: str
    hf_architectures: tuple[str, ...]
    """HF `architectures` entries this family serves."""
    model_types: tuple[str, ...]
    """HF `model_type` values, used when `architectures` names none of the above."""
    parse_config: Callable[[dict, Any], ModelConfig]
    model: Callable[[ModelConfig], nn.Module]
    plan: Callable[[ModelConfig, int], ShardPlan]
    check_tp: Callable[[ModelConfig, int], None]
    """ValueError naming the first dimension a TP size cannot split."""


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", ("LlamaForCausalLM",), ("llama",),
                 decoder_config("llama", modules=decoder_module_table),
                 LlamaForCausalLM, decoder_plan, check_decoder_tp),
    Architecture("qwen3", ("Qwen3ForCausalLM",), ("qwen3",),
                 decoder_config("qwen3", qk_norm=True, modules=decoder_module_table),
                 Qwen3ForCausalLM, decoder_plan, check_decoder_tp),
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",),
                 decoder_config("qwen3_moe", qk_norm=True, norm_topk_prob=False,
                                modules=decoder_module_table),
                 Qwen3MoeForCausalLM, decoder_plan, check_decoder_tp),
    Architecture("qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
                 ("qwen3_5_moe", "qwen3_5_moe_text"), qwen3_5_moe_config, Qwen35MoeForCausalLM,
                 qwen3_5_moe_plan, check_qwen3_5_moe_tp),
)}


def architecture(hf: dict) -> Architecture:
    """The family serving an HF config (from `architectures`, else `model_type`), or a
    ConfigError listing the supported architectures."""
    archs = hf.get("architectures") or []
    for family in ARCHITECTURES.values():
        if any(a in family.hf_architectures for a in archs):
            return family
    for family in ARCHITECTURES.values():
        if hf.get("model_type") in family.model_types:
            return family
    supported = sorted(a for f in ARCHITECTURES.values() for a in f.hf_architectures)
    raise ConfigError(f"unsupported architecture {archs or hf.get('model_type')!r}; "
                      f"supported: {', '.join(supported)}")


def config_from_hf(hf: dict, quantization: Any = None) -> ModelConfig:
    """The ModelConfig of an HF config dict, parsed by its family's parser. `quantization`:
    the checkpoint's QuantScheme, else config.json's `quantization_config` is read."""
    return parse_config(architecture(hf).parse_config, hf, quantization)


def load_config(folder: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder; a ConfigError naming the file otherwise."""
    hf, quantization = read_hf_config(folder)
    try:
        return config_from_hf(hf, quantization)
    except ConfigError as e:
        raise ConfigError(f"{Path(folder) / 'config.json'}: {e}") from None


def build_model(cfg: ModelConfig, tp_invariant: bool = False) -> nn.Module:
    """The rank-local model for `cfg` (the TP size comes from `get_tp_info()`); with
    `tp_invariant` its layers take the canonical reductions of `invariant_reductions`."""
    reductions = invariant_reductions(cfg, get_tp_info().size) if tp_invariant else None
    with canonical_reductions(reductions):
        return ARCHITECTURES[cfg.arch].model(cfg)


def shard_plan(cfg: ModelConfig, tp_size: int) -> ShardPlan:
    """The declarative shard plan for `cfg` at `tp_size` ranks."""
    return ARCHITECTURES[cfg.arch].plan(cfg, tp_size)


MAX_CHUNKS = 1024
"""No real model splits beyond this many ranks; bounds the search for the chunk count."""


def canonical_chunks(cfg: ModelConfig) -> int:
    """The tp_invariant mode's chunk count C: the largest power-of-two TP size `cfg`
    supports (every smaller power of two then divides it, and its splits too)."""
    size = 1
    while size < MAX_CHUNKS:
        try:
            check_tp(cfg, 2 * size)
        except ValueError:
            break
        size *= 2
    return size


def invariant_reductions(cfg: ModelConfig, tp_size: int) -> CanonicalReductions:
    """How `cfg`'s TP-split sums are cut at `tp_size` ranks in the tp_invariant mode; a
    ValueError naming tp_size when it is not a power of two dividing the chunk count."""
    check_tp(cfg, tp_size)
    return CanonicalReductions(canonical_chunks(cfg), tp_size)


def check_tp(cfg: ModelConfig, tp_size: int) -> None:
    """Raise a ValueError naming the first dimension `tp_size` cannot split."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    ARCHITECTURES[cfg.arch].check_tp(cfg, tp_size)
