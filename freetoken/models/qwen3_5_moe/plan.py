"""The Qwen3.5-MoE shard plan, as data, for both checkpoint layouts (`model.` or
`model.language_model.`); the vision tower (`model.visual.*`) and the multi-token-prediction
head (`mtp.*`) are not part of the engine and are ignored."""

from __future__ import annotations

import math
import re

from freetoken.formats.nvfp4.format import GROUP
from freetoken.formats.quant import FP8_BLOCK
from freetoken.formats.specs import (
    Heads,
    InterleavedHeads,
    PaddedSplit,
    Replicate,
    Segments,
    Split,
)
from freetoken.layers.layout import LocalRows
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts
from freetoken.loading.plan import Rule, ShardPlan
from freetoken.models.qwen3_5_moe.attention import QGateKVParallelLinear
from freetoken.models.qwen3_5_moe.config import Qwen35MoeConfig
from freetoken.models.qwen3_5_moe.gdn import GatedDeltaNet
from freetoken.models.qwen3_5_moe.moe import SharedExpert
from freetoken.models.scale_rules import (
    block_scale_rules,
    fp8_expert_rules,
    lm_head_rules,
    qwen3_5_parts,
)
from freetoken.models.shard_rules import check_decoder_tp, check_nvfp4_inputs, expert_rules

DEST = r"model.layers.\g<l>"


def qwen3_5_moe_plan(cfg: Qwen35MoeConfig, tp: int) -> ShardPlan:
    """The plan at `tp` ranks."""
    prefix = re.escape(cfg.checkpoint_prefix)
    layer = rf"{prefix}\.layers\.(?P<l>\d+)"
    rules = [
        Rule(rf"{prefix}\.embed_tokens\.weight", PaddedSplit(cfg.vocab_size),
             "model.embed_tokens.weight"),
        Rule(rf"{prefix}\.norm\.weight", Replicate(), "model.norm.weight"),
        # A tied checkpoint may still carry lm_head.weight; HF ignores it, so do we.
        Rule(r"lm_head\.weight", PaddedSplit(cfg.vocab_size),
             None if cfg.tie_word_embeddings else "lm_head.weight"),
        Rule(rf"{layer}\.(?P<n>input_layernorm|post_attention_layernorm)\.weight", Replicate(),
             rf"{DEST}.\g<n>.weight"),
        Rule(r"model\.visual\..+", param=None),
        Rule(r"mtp\..+", param=None),
    ]
    scales = block_scale_rules(cfg, range(cfg.num_hidden_layers),
                               qwen3_5_parts(cfg, cfg.checkpoint_prefix), tp)
    return ShardPlan(rules + attention_rules(cfg, tp, layer) + gdn_rules(cfg, tp, layer)
                     + moe_rules(cfg, tp, layer) + scales + lm_head_rules(cfg), tp)


def attention_rules(cfg: Qwen35MoeConfig, tp: int, layer: str) -> list[Rule]:
    """q_proj (per-head [q | gate] rows) by head into the q and gate slots of the fused
    projection; k and v by KV head, replicated when fewer than ranks; o_proj on its input."""
    src, dest = rf"{layer}\.self_attn", rf"{DEST}.self_attn"
    rows = QGateKVParallelLinear.layout(cfg, tp)
    kinds = ["weight", "bias"] if cfg.attention_bias else ["weight"]
    q_gate = InterleavedHeads(cfg.num_attention_heads, names=("q", "gate"))
    specs = {"q": (q_gate, rows.slot("q", "gate")),
             "k": (Heads(cfg.num_key_value_heads), rows.slot("k")),
             "v": (Heads(cfg.num_key_value_heads), rows.slot("v"))}
    rules = [Rule(rf"{src}\.{x}_proj\.{kind}", spec, f"{dest}.qkv_proj.{kind}", (slot,))
             for x, (spec, slot) in specs.items() for kind in kinds]
    rules.append(Rule(rf"{src}\.o_proj\.weight", Split(1), f"{dest}.o_proj.weight"))
    if cfg.attention_bias:
        rules.append(Rule(rf"{src}\.o_proj\.bias", Replicate(), f"{dest}.o_proj.bias"))
    rules.append(Rule(rf"{src}\.(?P<n>q_norm|k_norm)\.weight", Replicate(),
                      rf"{dest}.\g<n>.weight"))
    return rules


def gdn_packed_spec(cfg: Qwen35MoeConfig) -> Segments:
    """`[q | k | v]` rows of in_proj_qkv and conv1d, each segment split by head."""
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return Segments((key, key, value), dim=0, names=("q", "k", "v"),
                    unit=math.gcd(cfg.linear_key_head_dim, cfg.linear_value_head_dim))


def gdn_rules(cfg: Qwen35MoeConfig, tp: int, layer: str) -> list[Rule]:
    """in_proj_qkv per q/k/v segment, in_proj_z/b/a by value head, into the slots of the
    fused in_proj; conv1d per segment; A_log and dt_bias by value head; out_proj on its input;
    the gated norm (over one head's dv channels) replicated."""
    src, dest = rf"{layer}\.linear_attn", rf"{DEST}.linear_attn"
    rows = GatedDeltaNet.in_proj_layout(cfg, tp)
    packed = gdn_packed_spec(cfg)
    return [
        Rule(rf"{src}\.in_proj_qkv\.weight", packed, f"{dest}.in_proj.weight",
             (rows.slot("q", "v"),)),
        Rule(rf"{src}\.in_proj_z\.weight", Split(0), f"{dest}.in_proj.weight",
             (rows.slot("z"),)),
        *_ba_rules(cfg, rows, dest),
        Rule(rf"{src}\.conv1d\.weight", packed, f"{dest}.conv1d.weight"),
        Rule(rf"{src}\.(?P<n>A_log|dt_bias)", Split(0), rf"{dest}.\g<n>"),
        Rule(rf"{src}\.norm\.weight", Replicate(), f"{dest}.norm.weight"),
        Rule(rf"{src}\.out_proj\.weight", Split(1), f"{dest}.out_proj.weight"),
    ]


def _ba_rules(cfg: Qwen35MoeConfig, rows: LocalRows, dest: str) -> list[Rule]:
    """in_proj_b and in_proj_a by value head: into the fused in_proj after q|k|v|z, or, in
    layers whose qkv|z is quantized, into the unquantized in_proj_ba of their own."""
    split = [i for i in range(cfg.num_hidden_layers)
             if cfg.gemm_count(f"model.layers.{i}.linear_attn.in_proj") > 1]
    fused = [i for i in range(cfg.num_hidden_layers)
             if cfg.is_linear_layer(i) and i not in split]
    rules = []
    for layers, param, held in ((fused, "in_proj", rows), (split, "in_proj_ba",
                                                           rows.select("b", "a"))):
        if not layers:
            continue
        pattern = (rf"{re.escape(cfg.checkpoint_prefix)}\.layers\."
                   rf"(?P<l>{'|'.join(map(str, layers))})\.linear_attn")
        rules += [Rule(rf"{pattern}\.in_proj_{x}\.weight", Split(0),
                       f"{dest}.{param}.weight", (held.slot(x),))
                  for x in "ba"]
    return rules


def moe_rules(cfg: Qwen35MoeConfig, tp: int, layer: str) -> list[Rule]:
    """Router and shared-expert gate replicated; the shared expert like a dense MLP (gate and
    up split separately into gate_up_proj, down on its input); per-expert keys into the
    stacked w13 / w2, split on the intermediate dimension."""
    src, dest = rf"{layer}\.mlp", rf"{DEST}.mlp"
    shared = SharedExpert.layout(cfg.shared_expert_intermediate_size, tp)
    expert = rf"{src}\.experts\.(?P<e>\d+)"
    return [
        Rule(rf"{src}\.(?P<n>gate|shared_expert_gate)\.weight", Replicate(),
             rf"{dest}.\g<n>.weight"),
        Rule(rf"{src}\.shared_expert\.gate_proj\.weight", Split(0),
             f"{dest}.shared_expert.gate_up_proj.weight", (shared.slot("gate"),)),
        Rule(rf"{src}\.shared_expert\.up_proj\.weight", Split(0),
             f"{dest}.shared_expert.gate_up_proj.weight", (shared.slot("up"),)),
        Rule(rf"{src}\.shared_expert\.down_proj\.weight", Split(1),
             f"{dest}.shared_expert.down_proj.weight"),
    ] + _experts(cfg, expert, f"{dest}.experts", tp)


def _experts(cfg: Qwen35MoeConfig, expert: str, dest: str, tp: int) -> list[Rule]:
    """Routed-expert rules: unquantized, NVFP4 or block FP8 (one format in every layer)."""
    fmt = cfg.format_of("model.layers.0.mlp.experts")
    if fmt is not None and fmt.kind == FP8_BLOCK:
        return fp8_expert_rules(expert, dest, cfg.moe_intermediate_size, tp, fmt)
    return expert_rules(expert, dest, cfg.moe_intermediate_size, tp,
                        cfg.quantization.producer if cfg.nvfp4_experts else None)


def check_qwen3_5_moe_tp(cfg: Qwen35MoeConfig, tp: int) -> None:
    """ValueError naming the first dimension `tp` ranks cannot split: the decoder's, then the
    GatedDeltaNet heads and the shared expert; NVFP4 experts split their inputs (down_proj's)
    on 16-element group boundaries, checked before any rank starts."""
    check_decoder_tp(cfg, tp)
    GatedDeltaNet.in_proj_layout(cfg, tp)
    SharedExpert.layout(cfg.shared_expert_intermediate_size, tp)
    check_nvfp4_inputs(cfg, tp, {"shared_expert.down_proj": (
        cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size")})
    if cfg.nvfp4_experts:
        if cfg.hidden_size % GROUP:
            raise ValueError(f"hidden_size={cfg.hidden_size} is not a multiple of the "
                             f"{GROUP}-element NVFP4 group")
        NVFP4FusedExperts.layout(cfg.moe_intermediate_size, tp)
