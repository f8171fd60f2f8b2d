"""Qwen3.5-MoE's modules as a checkpoint names them, mapped onto the engine's destinations
(`module_table`), and which formats the engine runs each in: the routed experts in NVFP4
(either producer) or block FP8; attention, GatedDeltaNet in_proj_qkv / in_proj_z / out_proj
and the shared expert in block FP8; everything else unquantized. GDN `in_proj` fuses
in_proj_qkv, in_proj_z, in_proj_b and in_proj_a: quantized, it splits into a [qkv | z] GEMM
in that format and an unquantized [b | a] one; in_proj_b and in_proj_a (one row per value
head: 32 rows at 35B, a few per rank) and the routers are never quantized by any producer
and are refused in a quantized format."""

from __future__ import annotations

from freetoken.config import ConfigError
from freetoken.formats.quant import BF16, FP8_BLOCK, FP8_TENSOR, NVFP4, Destination, ModuleTable

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DEST = "model.layers"
_PER_HEAD = "one row per value head; kept unquantized by every producer"
_ROUTER = "a router; kept unquantized by every producer"
BLOCK = frozenset({FP8_BLOCK, FP8_TENSOR})
"""The quantized formats of the GDN linears."""
DENSE = BLOCK | {NVFP4}
"""The quantized formats of attention and shared-expert linears."""


def module_table(prefix: str, layer_types: tuple[str, ...], num_experts: int) -> ModuleTable:
    """Every linear destination of the model (engine names, `model.layers.L...`) with its
    checkpoint parts (`prefix.layers.L...`), and the non-linear modules a config may name."""
    dests = [Destination("lm_head", ("lm_head",), frozenset({NVFP4}))]
    others = [f"{prefix}.embed_tokens", f"{prefix}.norm", f"{prefix}.rotary_emb"]
    for i, kind in enumerate(layer_types):
        src, dest = f"{prefix}.layers.{i}", f"{DEST}.{i}"
        dests += _attention(src, dest) if kind == "full_attention" else _gdn(src, dest)
        dests += _moe(src, dest, num_experts)
        others += [f"{src}.input_layernorm", f"{src}.post_attention_layernorm",
                   f"{src}.self_attn.q_norm", f"{src}.self_attn.k_norm",
                   f"{src}.linear_attn.conv1d", f"{src}.linear_attn.norm",
                   # Parameters, not modules, but Qwen's FP8 releases list them in
                   # modules_to_not_convert (quant_formats.md, section 3).
                   f"{src}.linear_attn.A_log", f"{src}.linear_attn.dt_bias"]
    return ModuleTable(tuple(dests), tuple(others))


def _attention(src: str, dest: str) -> list[Destination]:
    a, d = f"{src}.self_attn", f"{dest}.self_attn"
    return [Destination(f"{d}.qkv_proj", tuple(f"{a}.{x}_proj" for x in "qkv"), DENSE),
            Destination(f"{d}.o_proj", (f"{a}.o_proj",), DENSE)]


def _gdn(src: str, dest: str) -> list[Destination]:
    a, d = f"{src}.linear_attn", f"{dest}.linear_attn"
    parts = tuple(f"{a}.in_proj_{x}" for x in ("qkv", "z", "b", "a"))
    return [Destination(f"{d}.in_proj", parts, BLOCK, splittable=True, bf16_only=parts[2:],
                        note=_PER_HEAD),
            Destination(f"{d}.out_proj", (f"{a}.out_proj",), BLOCK)]


def _moe(src: str, dest: str, num_experts: int) -> list[Destination]:
    m, d = f"{src}.mlp", f"{dest}.mlp"
    experts = tuple(f"{m}.experts.{e}.{p}" for e in range(num_experts) for p in PROJECTIONS)
    return [Destination(f"{d}.gate", (f"{m}.gate",), note=_ROUTER),
            Destination(f"{d}.shared_expert_gate", (f"{m}.shared_expert_gate",), note=_ROUTER),
            Destination(f"{d}.shared_expert.gate_up_proj",
                        (f"{m}.shared_expert.gate_proj", f"{m}.shared_expert.up_proj"), DENSE),
            Destination(f"{d}.shared_expert.down_proj", (f"{m}.shared_expert.down_proj",),
                        DENSE),
            Destination(f"{d}.experts", experts, frozenset({NVFP4, FP8_BLOCK}), stacked=True)]


def nvfp4_experts(module_formats: dict, layer_types: tuple[str, ...]) -> bool:
    """Whether the routed experts are NVFP4 under the resolved `module_formats` (engine
    module -> GEMMs; empty for an unquantized checkpoint). ConfigError naming the layers
    when the layers' experts differ in format, or a GDN in_proj is not split as
    [qkv | z] quantized and [b | a] unquantized."""
    if not module_formats:
        return False
    kinds = {i: module_formats[f"{DEST}.{i}.mlp.experts"][0].format for i in
             range(len(layer_types))}
    if len(set(kinds.values())) > 1:
        (a, fa), (b, fb) = [next((i, f) for i, f in kinds.items() if f == x)
                            for x in list(dict.fromkeys(kinds.values()))[:2]]
        raise ConfigError(f"the quantization config makes the routed experts of layer {a} "
                          f"{fa.describe()} but layer {b}'s {fb.describe()}; FreeToken needs "
                          "every layer's routed experts in one format")
    for i, kind in enumerate(layer_types):
        if kind == "linear_attention":
            _check_in_proj(f"{DEST}.{i}.linear_attn.in_proj", module_formats)
    return kinds[0].kind == NVFP4


def _check_in_proj(name: str, module_formats: dict) -> None:
    gemms = module_formats[name]
    if len(gemms) == 1 or (len(gemms) == 2 and len(gemms[0].parts) == 2
                           and gemms[1].format.kind == BF16):
        return
    split = " | ".join(f"[{', '.join(p.rpartition('.')[2] for p in g.parts)}] "
                       f"{g.format.describe()}" for g in gemms)
    raise ConfigError(f"{name}: the quantization config splits it as {split}; FreeToken runs "
                      "in_proj_qkv and in_proj_z in one format")
