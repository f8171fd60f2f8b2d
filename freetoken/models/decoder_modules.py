"""The Llama, Qwen3 and Qwen3-MoE modules as a checkpoint names them, mapped onto the
engine's destinations (q|k|v into `qkv_proj`, gate|up into `gate_up_proj`, per-expert
projections into the stacked experts), with the formats the engine runs each in
(`freetoken.formats.quant.resolve` reads a quantization config against it)."""

from __future__ import annotations

from freetoken.config import ModelConfig
from freetoken.formats.quant import (
    FP8_BLOCK,
    FP8_TENSOR,
    NVFP4,
    Destination,
    ModuleFormat,
    ModuleTable,
)

DENSE_FORMATS: frozenset[str] = frozenset({FP8_BLOCK, FP8_TENSOR, NVFP4})
"""Quantized formats of the attention and dense-MLP linears (bf16 is always accepted)."""
_ROUTER = "a router; kept unquantized by every producer"


def decoder_module_table(cfg: ModelConfig) -> ModuleTable:
    """Every linear destination (engine names equal the checkpoint's here) and the other
    modules a quantization config may name."""
    dests = [Destination("lm_head", ("lm_head",), frozenset({NVFP4}))]
    others = ["model.embed_tokens", "model.norm", "model.rotary_emb"]
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        dests += [Destination(f"{a}.qkv_proj", tuple(f"{a}.{x}_proj" for x in "qkv"),
                              DENSE_FORMATS),
                  Destination(f"{a}.o_proj", (f"{a}.o_proj",), DENSE_FORMATS)]
        if cfg.is_moe_layer(i):
            experts = tuple(f"{m}.experts.{e}.{p}_proj" for e in range(cfg.num_experts)
                            for p in ("gate", "up", "down"))
            dests += [Destination(f"{m}.gate", (f"{m}.gate",), note=_ROUTER),
                      Destination(f"{m}.experts", experts, frozenset({NVFP4, FP8_BLOCK}),
                                  stacked=True)]
        else:
            dests += [Destination(f"{m}.gate_up_proj", (f"{m}.gate_proj", f"{m}.up_proj"),
                                  DENSE_FORMATS),
                      Destination(f"{m}.down_proj", (f"{m}.down_proj",), DENSE_FORMATS)]
        others += [f"model.layers.{i}.input_layernorm",
                   f"model.layers.{i}.post_attention_layernorm",
                   f"{a}.q_norm", f"{a}.k_norm"]
    return ModuleTable(tuple(dests), tuple(others))


def experts_format(cfg: ModelConfig) -> ModuleFormat | None:
    """The routed experts' format (None: unquantized), the same in every MoE layer; a
    ValueError naming two layers whose experts differ."""
    found = {i: cfg.format_of(f"model.layers.{i}.mlp.experts")
             for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)}
    kinds = list(dict.fromkeys(found.values()))
    if len(kinds) > 1:
        a, b = (next(i for i, f in found.items() if f == k) for k in kinds[:2])
        describe = [k.describe() if k is not None else "unquantized" for k in kinds[:2]]
        raise ValueError(f"the routed experts of layer {a} are {describe[0]} but layer {b}'s "
                         f"{describe[1]}; FreeToken needs every layer's experts in one format")
    return kinds[0] if kinds else None
