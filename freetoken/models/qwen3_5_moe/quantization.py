"""Which Qwen3.5-MoE modules a quantized checkpoint may store in NVFP4: the routed experts
only. Attention, GatedDeltaNet, router, shared expert and LM head stay unquantized, as in
NVIDIA's NVFP4 releases; a config that lists one of them as quantized is refused by name."""

from __future__ import annotations

from freetoken.config import ConfigError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_UNQUANTIZED = {
    "full_attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj"),
    "linear_attention": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
                         "linear_attn.in_proj_b", "linear_attn.in_proj_a",
                         "linear_attn.out_proj"),
    "mlp": ("mlp.gate", "mlp.shared_expert_gate", "mlp.shared_expert.gate_proj",
            "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"),
}


def nvfp4_experts(quantization, prefix: str, layer_types: tuple[str, ...],
                  num_experts: int) -> bool:
    """Whether the routed experts are NVFP4 under `quantization` (an NVFP4Config or None).

    ConfigError naming the module when a module the engine runs unquantized is listed as
    quantized, or when experts are quantized in some layers (or projections) and not in
    others. Experts are checked at the first and the last index of each layer: exclusion
    lists name whole expert groups, not single experts."""
    if quantization is None:
        return False
    for module in _unquantized_modules(prefix, layer_types):
        if quantization.is_quantized(module):
            raise ConfigError(f"{module} is NVFP4 in the checkpoint's quantization config, "
                              "but FreeToken runs only the routed experts of Qwen3.5-MoE in "
                              "NVFP4 (attention, GatedDeltaNet, router, shared expert and "
                              "lm_head must be unquantized)")
    experts = [f"{prefix}.layers.{i}.mlp.experts.{e}.{p}" for i in range(len(layer_types))
               for e in sorted({0, num_experts - 1}) for p in PROJECTIONS]
    quantized = {m: quantization.is_quantized(m) for m in experts}
    if len(set(quantized.values())) > 1:
        on = next(m for m, q in quantized.items() if q)
        off = next(m for m, q in quantized.items() if not q)
        raise ConfigError(f"the quantization config makes {on} NVFP4 but excludes {off}; "
                          "FreeToken needs every routed expert in NVFP4 or none")
    return all(quantized.values())


def _unquantized_modules(prefix: str, layer_types: tuple[str, ...]) -> list[str]:
    modules = ["lm_head"]
    for i, kind in enumerate(layer_types):
        modules += [f"{prefix}.layers.{i}.{m}" for m in _UNQUANTIZED[kind] + _UNQUANTIZED["mlp"]]
    return modules
