"""Engine and model configuration. The generic half of reading a checkpoint's config: the
folder's `config.json` and quantization config (`read_hf_config`), the fields every decoder
shares with HF's config quirks normalised once (transformers 4 vs 5 key names, rope layouts;
`common_fields`), and the error wrapping (`parse_config`). Which parser an architecture uses
is `freetoken.models.registry`'s table (`load_config`): nothing here knows a model family."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from freetoken.formats.quant import (
    ModuleTable,
    QuantConfigError,
    parse_quant_config,
    read_quant_config,
    resolve,
)


class ConfigError(ValueError):
    """A checkpoint's config.json is missing, unreadable or unsupported."""


# Sizes a model cannot have zero of; every other integer field may be 0 (absent feature).
_POSITIVE = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings",
             "decoder_sparse_step", "linear_conv_kernel_dim"}


def _check_number(name: str, value, kind: str) -> None:
    """Types and ranges of one ModelConfig field (`kind` is its annotation)."""
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        low = 1 if name in _POSITIVE else 0
        if value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{name} must be a finite number above 0, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """The model facts the engine needs, with global (unsharded) sizes."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    quantization: Any = None
    """The checkpoint's `QuantScheme` (which module is in which format, in whose tensor
    naming), None for an unquantized checkpoint."""
    module_formats: dict = field(default_factory=dict, compare=False, repr=False)
    """Engine module -> its GEMMs (`freetoken.formats.quant.Gemm`), resolved against the
    family's module table (`resolve_formats`); empty for an unquantized checkpoint."""
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_number(f.name, getattr(self, f.name), f.type)
        if self.partial_rotary_factor > 1:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got "
                              f"{self.partial_rotary_factor}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                              f"1..num_experts={self.num_experts}")

    def format_of(self, module: str, gemm: int | None = None):
        """The ModuleFormat engine module `module` (e.g. `model.layers.0.mlp.down_proj`), or
        its GEMM number `gemm`, is stored in; None when unquantized. A module resolved into
        several GEMMs has no single format: ValueError naming it unless `gemm` is given."""
        gemms = self.module_formats.get(module)
        if not gemms:
            return None
        if gemm is None and len(gemms) > 1:
            raise ValueError(f"{module} is stored in {len(gemms)} formats; ask per GEMM")
        fmt = gemms[gemm or 0].format
        return fmt if fmt.quantized else None

    def gemm_count(self, module: str) -> int:
        """How many GEMMs engine module `module` resolved into (1 when unquantized)."""
        return len(self.module_formats.get(module) or (None,))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def truncated(self, num_layers: int) -> ModelConfig:
        """The same model with only its first `num_layers` decoder layers."""
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise ConfigError(f"num_layers={num_layers} outside 1..{self.num_hidden_layers}")
        return replace(self, num_hidden_layers=num_layers)


def read_hf_config(folder: str | Path) -> tuple[dict, Any]:
    """A checkpoint folder's `config.json` as a dict, and its QuantScheme
    (`hf_quant_config.json` first, else config.json's `quantization_config`; None when
    unquantized). ConfigError naming the file when either is missing or unreadable."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json (not a checkpoint folder)")
    try:
        hf = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: not a JSON object")
    try:
        return hf, read_quant_config(Path(folder))
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def parse_config(parser: Callable[[dict, Any], ModelConfig], hf: dict,
                 quantization: Any = None) -> ModelConfig:
    """`parser(hf, quantization)` (an architecture's config parser), with any malformed or
    missing key reported as one ConfigError. `quantization`: the checkpoint's QuantScheme
    when read from its folder; else config.json's `quantization_config`, if any."""
    try:
        if quantization is None:
            quantization = _parse_quantization(hf.get("quantization_config"))
        return parser(hf, quantization)
    except ConfigError:
        raise
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None
    except KeyError as e:
        raise ConfigError(f"missing key {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise ConfigError(f"malformed ({type(e).__name__}: {e})") from None


def _parse_quantization(raw: dict | None):
    """config.json's `quantization_config` as a QuantScheme (None when absent)."""
    try:
        return parse_quant_config(raw, "config.json quantization_config")
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def resolve_formats(quantization: Any, table: ModuleTable) -> dict:
    """Every engine module's GEMMs under `quantization` (a QuantScheme or None), against a
    family's module `table`; {} for an unquantized checkpoint. ConfigError naming the
    module when the config does not fit the model (see `freetoken.formats.quant.resolve`)."""
    if quantization is None:
        return {}
    try:
        return resolve(quantization, table)
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def decoder_config(arch: str, qk_norm: bool = False, norm_topk_prob: bool = True,
                   modules: Callable[[ModelConfig], ModuleTable] | None = None
                   ) -> Callable[[dict, Any], ModelConfig]:
    """The config parser of a plain decoder family (`arch`): the common fields, per-head q/k
    RMSNorm when `qk_norm`, `norm_topk_prob` when the HF config leaves it out. A quantized
    checkpoint is resolved against `modules(cfg)`, the family's module table (refused
    when the family has none)."""

    def parse(hf: dict, quantization: Any) -> ModelConfig:
        if quantization is not None and modules is None:
            raise ConfigError(f"{arch}: quantized checkpoints are not supported for this "
                              "architecture")
        fields = common_fields(hf, arch)
        fields.update(qk_norm=qk_norm,
                      norm_topk_prob=bool(hf.get("norm_topk_prob", norm_topk_prob)))
        cfg = ModelConfig(**fields, quantization=quantization)
        if quantization is None:
            return cfg
        return replace(cfg, module_formats=resolve_formats(quantization, modules(cfg)))

    return parse


def common_fields(hf: dict, arch: str) -> dict:
    """ModelConfig's fields from a flat (text) HF config dict, the ones every decoder reads
    alike; a family's parser sets or overrides the rest."""
    heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    eos = hf.get("eos_token_id")
    return dict(
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf.get("intermediate_size", 0),
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        # A zero or non-integer head count is reported by ModelConfig's own checks.
        head_dim=hf.get("head_dim") or (hf["hidden_size"] // heads
                                        if isinstance(heads, int) and heads > 0 else 0),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=hf.get("partial_rotary_factor", 1.0),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        num_experts=hf.get("num_experts") or hf.get("num_local_experts") or 0,
        num_experts_per_tok=hf.get("num_experts_per_tok", 0),
        moe_intermediate_size=hf.get("moe_intermediate_size", 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        raw=hf,
    )


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (transformers 4)."""
    params = hf.get("rope_parameters")
    if params:
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return float(params.get("rope_theta", 10000.0)), scaling
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(hf.get("rope_theta", 10000.0)), scaling


@dataclass(frozen=True)
class EngineConfig:
    """What one rank's engine reads: dtype, cache and batch limits, the layer count, eager and
    tp_invariant modes. Where the engine runs (the checkpoint, the TP size, the device, the
    rank group's timeout) is the launcher's (`LLM(...)`'s arguments); the model is the
    `ModelConfig` the launcher parsed and validated."""

    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int = 8192
    num_kv_blocks: int | None = None
    num_layers: int | None = None
    progress: bool = True
    enforce_eager: bool = False
    """Run decode steps eagerly on CUDA too (no CUDA graphs)."""
    tp_invariant: bool = False
    """Compute every TP-split sum in one canonical order (`freetoken.layers.invariant`): TP=N
    logits bit-identical to TP=1, at some cost in speed; CPU torch paths only."""
    overlap_steps: bool | None = None
    """Launch a step before the previous step's tokens reach the host, its ids fed back on
    the device (greedy sequences without per-step logits, TP 1): the host's scheduling and
    bookkeeping then run while the GPU computes. None: where decode runs as CUDA graphs;
    True: at TP 1 on any device (eager too); False: never."""
