"""Qwen3.5-MoE configuration from either HF layout: a text-only `qwen3_5_moe_text` config
(`Qwen3_5MoeForCausalLM`, weights under `model.`), or the multimodal `qwen3_5_moe` config
(`Qwen3_5MoeForConditionalGeneration`, the text model in `text_config`, weights under
`model.language_model.`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from freetoken.config import ConfigError, ModelConfig, common_fields, resolve_formats
from freetoken.models.qwen3_5_moe.quantization import module_table, nvfp4_experts

LINEAR, FULL = "linear_attention", "full_attention"
# HF's Qwen3_5MoeTextConfig defaults for keys a config.json may leave out.
DEFAULT_PARTIAL_ROTARY = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4


@dataclass(frozen=True)
class Qwen35MoeConfig(ModelConfig):
    """ModelConfig plus the GatedDeltaNet and shared-expert sizes (global, unsharded) and
    where the text model's weights live in the checkpoint."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    shared_expert_intermediate_size: int = 0
    checkpoint_prefix: str = "model"
    nvfp4_experts: bool = False
    """Routed experts stored in NVFP4 (`quantization` says how); everything else unquantized."""

    def is_linear_layer(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def truncated(self, num_layers: int) -> Qwen35MoeConfig:
        cfg = super().truncated(num_layers)
        return replace(cfg, layer_types=self.layer_types[:num_layers])


def qwen3_5_moe_config(hf: dict, quantization=None) -> Qwen35MoeConfig:
    """Parse either layout; the multimodal wrapper's vision tower is not part of the engine.
    `quantization`: the checkpoint's QuantScheme, or None (see `freetoken.config.parse_config`)."""
    multimodal = isinstance(hf.get("text_config"), dict)
    text = hf["text_config"] if multimodal else hf
    fields = common_fields(text, "qwen3_5_moe")
    num_layers = fields["num_hidden_layers"]
    rope = text.get("rope_parameters") or {}
    fields.update(
        # Qwen3.5 q/k norms are always present; routing always renormalises the top-k.
        qk_norm=True,
        norm_topk_prob=True,
        partial_rotary_factor=float(_first(rope.get("partial_rotary_factor"),
                                           text.get("partial_rotary_factor"),
                                           DEFAULT_PARTIAL_ROTARY)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings",
                                        text.get("tie_word_embeddings", False))),
        dtype=str(text.get("dtype") or text.get("torch_dtype") or hf.get("dtype")
                  or hf.get("torch_dtype") or "float32"),
        eos_token_ids=_eos(text.get("eos_token_id", hf.get("eos_token_id"))),
        quantization=quantization,
        raw=hf,
    )
    layer_types = _layer_types(text, num_layers)
    prefix = "model.language_model" if multimodal else "model"
    formats = resolve_formats(quantization, module_table(prefix, layer_types,
                                                         fields["num_experts"]))
    cfg = Qwen35MoeConfig(
        **fields,
        layer_types=layer_types,
        linear_num_key_heads=_required(text, "linear_num_key_heads"),
        linear_num_value_heads=_required(text, "linear_num_value_heads"),
        linear_key_head_dim=_required(text, "linear_key_head_dim"),
        linear_value_head_dim=_required(text, "linear_value_head_dim"),
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
        shared_expert_intermediate_size=_required(text, "shared_expert_intermediate_size"),
        checkpoint_prefix=prefix,
        module_formats=formats,
        nvfp4_experts=nvfp4_experts(formats, layer_types),
    )
    _validate(cfg)
    return cfg


def _first(*values):
    return next(v for v in values if v is not None)


def _eos(eos) -> tuple[int, ...]:
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _required(text: dict, key: str) -> int:
    if key not in text:
        raise ConfigError(f"Qwen3.5-MoE config lacks {key!r}")
    value = text[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _layer_types(text: dict, num_layers: int) -> tuple[str, ...]:
    """`layer_types` when given, else every `full_attention_interval`-th layer is full
    attention (HF's rule)."""
    if text.get("layer_types"):
        types = tuple(text["layer_types"])
    else:
        interval = text.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL
        types = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for num_hidden_layers="
                          f"{num_layers}")
    unknown = sorted(set(types) - {LINEAR, FULL})
    if unknown:
        raise ConfigError(f"layer_types holds unsupported kinds {unknown}; expected "
                          f"{LINEAR!r} or {FULL!r}")
    return types


def _validate(cfg: Qwen35MoeConfig) -> None:
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if nk < 1 or nv % nk:
        raise ConfigError(f"linear_num_value_heads={nv} is not a multiple of "
                          f"linear_num_key_heads={nk}")
    if cfg.num_experts < 1 or cfg.num_experts_per_tok < 1:
        raise ConfigError("Qwen3.5-MoE needs num_experts and num_experts_per_tok")
    if cfg.rotary_dim % 2:
        raise ConfigError(f"rotary dim {cfg.rotary_dim} (head_dim={cfg.head_dim} x "
                          f"partial_rotary_factor={cfg.partial_rotary_factor}) is odd")
