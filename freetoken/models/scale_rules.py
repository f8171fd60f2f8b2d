"""Shard-plan rules for the scales of quantized linear modules, as data beside the weight
rules (`shard_rules`): the weights themselves split as the unquantized ones do (same shapes,
same specs), their scales follow the format. Block FP8: each checkpoint module's
`weight_scale_inv` (HF) or `weight_scale` (compressed-tensors) goes, split by a
`BlockScaleSplit` like its weight, into its own scale rows of the destination's
`weight_scale`: one slot per segment (q | k | v, gate | up), so no segment reads another's
scale. Stored static input scales (FP8 per tensor and block, `ModuleFormat.input_scales`)
go whole into their own entry of the destination's `input_scale`, checked finite and above 0
by `ScalarScale` and unused by the weight-only GEMM; the input scales the engine does not
keep (NVFP4's, dynamic-input FP8's) are dropped after the same check (`Rule.checked`), so a
broken export is refused whichever it is. Rules are grouped by layer where the layers'
formats agree."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from freetoken.formats.fp8.interleaved import InterleavedBlockRows
from freetoken.formats.fp8.specs import BlockScaleSegments, BlockScaleSplit
from freetoken.formats.fp8.tensor import ScalarScale
from freetoken.formats.nvfp4.specs import PACKED, SCALE, GlobalScale, InputSplit
from freetoken.formats.quant.format import FP8_BLOCK, FP8_TENSOR, NVFP4, ModuleFormat
from freetoken.formats.specs import Heads, InterleavedHeads, PaddedSplit, Split
from freetoken.layers.moe import FusedExperts
from freetoken.loading.plan import Rule

NVFP4_INPUT = ScalarScale(what="NVFP4 input scale")
"""The check of an NVFP4 input scale (ModelOpt `input_scale` 0-d or [1], compressed-tensors'
divisor `input_global_scale` [1]), dropped: W4A16 leaves activations unquantized."""


@dataclass(frozen=True)
class Part:
    """One checkpoint module filling part of destination `dest` (a template with `{layer}`):
    `name` its template, `rows` / `cols` how its weight's output and input dims split
    (`heads=1`: not split), `segment` its index among the destination's output segments."""

    name: str
    dest: str
    rows: tuple[int, int | None]
    cols: tuple[int, int | None]
    segment: int = 0
    gemm: int = 0
    """Which of the destination's GEMMs the part is in (GDN in_proj: qkv|z, then b|a)."""
    packed: tuple[int, ...] = ()
    """Row segment sizes of a packed checkpoint tensor (in_proj_qkv's q, k, v), each split
    on its own."""
    interleaved: int = 0
    """Heads of a per-head interleaved tensor (q_proj's [q_h | gate_h]): its scale is
    expanded to one row per weight row (`InterleavedBlockRows`)."""


def _scale_suffix(fmt: ModuleFormat) -> str:
    return next(s for s, f in fmt.suffixes().items() if f == "weight_scale")


def block_scale_rules(cfg, layers: range, parts: list[Part], tp: int) -> list[Rule]:
    """Rules for the scales of `parts` in every layer of `layers` whose destination is block
    FP8 or FP8 per tensor (formats from `cfg.format_of`); layers sharing a format share
    rules. Per tensor: each checkpoint tensor's 0-d `weight_scale` (and a stored
    `input_scale`, checked and unused) into its own entry of the destination's. A stored
    input scale the config does not declare (dynamic inputs) is checked and dropped."""
    by_format: dict[tuple, list[int]] = defaultdict(list)
    for layer in layers:
        for index, part in enumerate(parts):
            dest = part.dest.format(layer=layer)
            fmt = cfg.format_of(dest, part.gemm) if part.gemm < cfg.gemm_count(dest) else None
            if fmt is not None and fmt.kind in (FP8_BLOCK, FP8_TENSOR, NVFP4):
                by_format[(index, fmt)].append(layer)
    rules = []
    for (index, fmt), hits in by_format.items():
        part = parts[index]
        alternation = "|".join(str(i) for i in hits)
        src = re.escape(part.name).replace(re.escape("{layer}"), rf"(?P<l>{alternation})")
        dest = part.dest.replace("{layer}", r"\g<l>")
        if fmt.kind == FP8_TENSOR:
            rules += _tensor_scale_rules(src, dest, part.segment, fmt)
            continue
        if fmt.kind == NVFP4:
            rules += _nvfp4_rules(src, dest, part, parts, fmt, tp)
            continue
        start = sum(_spec_and_rows(p, fmt, tp)[1] for p in parts
                    if p.dest == part.dest and p.gemm == part.gemm and p.segment < part.segment)
        spec, rows = _spec_and_rows(part, fmt, tp)
        rules.append(Rule(rf"{src}\.{_scale_suffix(fmt)}", spec, f"{dest}.weight_scale",
                          (slice(start, start + rows),)))
        rules.append(_input_rule(rf"{src}\.{_input_suffix(fmt)}", fmt,
                                 f"{dest}.input_scale", (part.segment,)))
    return rules


def _input_suffix(fmt: ModuleFormat) -> str:
    return next(s for s, f in fmt.suffixes().items() if f == "input_scale")


def _input_rule(pattern: str, fmt: ModuleFormat, param: str, slot: tuple) -> Rule:
    """A stored FP8 input scale into `param` at `slot` when the config declares static
    inputs (`fmt.input_scales`), else checked the same way and dropped."""
    spec = ScalarScale(what=f"{'FP8 block' if fmt.kind == FP8_BLOCK else 'FP8 per-tensor'} "
                            "input scale")
    if fmt.input_scales:
        return Rule(pattern, spec, param, slot)
    return Rule(pattern, param=None, checked=spec)


def _tensor_scale_rules(src: str, dest: str, segment: int, fmt: ModuleFormat) -> list[Rule]:
    return [Rule(rf"{src}\.weight_scale", ScalarScale(what="FP8 per-tensor weight scale"),
                 f"{dest}.weight_scale", (segment,)),
            _input_rule(rf"{src}\.input_scale", fmt, f"{dest}.input_scale", (segment,))]


def _local_rows(part: Part, tp: int) -> int:
    rows, heads = part.rows
    return rows // (heads if heads is not None and heads < tp else tp)


def _nvfp4_rules(src: str, dest: str, part: Part, parts: list[Part], fmt: ModuleFormat,
                 tp: int) -> list[Rule]:
    """NVFP4 tensors of one part: packed weight and block scale split like an unquantized
    weight (rows per row; inputs on 16-element groups), into the part's rows of the
    destination; its global scale into its own entry of `weight_scale_2`; its input scale,
    unused by W4A16, checked finite and above 0 and dropped (`NVFP4_INPUT`). ModelOpt's
    packed `weight` is read by the weight rules."""
    names = {f: s for s, f in fmt.suffixes().items()}
    if part.rows[1] == 1:
        weight, scale, slot = InputSplit(PACKED, 1), InputSplit(SCALE, 1), ()
    else:
        weight = scale = (InterleavedHeads(part.interleaved) if part.interleaved
                          else Heads(part.rows[1]) if part.rows[1] else Split(0))
        start = sum(_local_rows(p, tp) for p in parts
                    if p.dest == part.dest and p.segment < part.segment)
        slot = (slice(start, start + _local_rows(part, tp)),)
    glob = GlobalScale((1,) if fmt.global_scale_is_reciprocal else ())
    rules = [Rule(rf"{src}\.{names['weight_scale']}", scale, f"{dest}.weight_scale", slot),
             Rule(rf"{src}\.{names['weight_scale_2']}", glob, f"{dest}.weight_scale_2",
                  (part.segment,)),
             Rule(rf"{src}\.{names['input_scale']}", param=None, checked=NVFP4_INPUT)]
    if names["weight"] != "weight":
        rules.append(Rule(rf"{src}\.{names['weight']}", weight, f"{dest}.weight", slot))
    return rules


def _spec_and_rows(part: Part, fmt: ModuleFormat, tp: int):
    """The scale's spec, split on the weight's split dim (rows unless the rows are whole),
    and the scale rows it fills on each rank."""
    if part.interleaved:
        return (InterleavedBlockRows(fmt.block[0], part.rows[0], part.interleaved),
                part.rows[0] // tp)
    if part.packed:
        starts = [sum(part.packed[:i]) for i in range(len(part.packed))]
        spec = BlockScaleSegments(tuple(
            BlockScaleSplit(0, fmt.block[0], n, None, s, part.rows[0])
            for n, s in zip(part.packed, starts)))
        return spec, sum(s.blocks(tp) for s in spec.segments)
    rows = BlockScaleSplit(0, fmt.block[0], *part.rows)
    if part.rows[1] == 1:
        return BlockScaleSplit(1, fmt.block[1], *part.cols), rows.blocks(tp)
    return rows, rows.blocks(tp)


def decoder_parts(cfg) -> list[Part]:
    """The Llama-family attention and dense-MLP modules and their destinations."""
    hd, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    a, m, h = "model.layers.{layer}.self_attn", "model.layers.{layer}.mlp", cfg.hidden_size
    i = cfg.intermediate_size
    return [Part(f"{a}.q_proj", f"{a}.qkv_proj", (heads * hd, None), (h, 1), 0),
            Part(f"{a}.k_proj", f"{a}.qkv_proj", (kv * hd, kv), (h, 1), 1),
            Part(f"{a}.v_proj", f"{a}.qkv_proj", (kv * hd, kv), (h, 1), 2),
            Part(f"{a}.o_proj", f"{a}.o_proj", (h, 1), (heads * hd, None)),
            Part(f"{m}.gate_proj", f"{m}.gate_up_proj", (i, None), (h, 1), 0),
            Part(f"{m}.up_proj", f"{m}.gate_up_proj", (i, None), (h, 1), 1),
            Part(f"{m}.down_proj", f"{m}.down_proj", (h, 1), (i, None))]


def lm_head_rules(cfg) -> list[Rule]:
    """An NVFP4 lm_head's block scales padded with zero rows like its packed weight (which
    `lm_head.weight` / CT's `weight_packed` fill), its global scale; its input scale checked
    and dropped."""
    fmt = cfg.format_of("lm_head")
    if fmt is None or fmt.kind != NVFP4:
        return []
    names = {f: s for s, f in fmt.suffixes().items()}
    glob = GlobalScale((1,) if fmt.global_scale_is_reciprocal else ())
    rules = [Rule(rf"lm_head\.{names['weight_scale']}", PaddedSplit(cfg.vocab_size)),
             Rule(rf"lm_head\.{names['weight_scale_2']}", glob, "lm_head.weight_scale_2", (0,)),
             Rule(rf"lm_head\.{names['input_scale']}", param=None, checked=NVFP4_INPUT)]
    if names["weight"] != "weight":
        rules.append(Rule(rf"lm_head\.{names['weight']}", PaddedSplit(cfg.vocab_size),
                          "lm_head.weight"))
    return rules


def fp8_expert_rules(expert: str, dest: str, full_intermediate: int, tp: int,
                     fmt: ModuleFormat) -> list[Rule]:
    """Per-expert block-FP8 tensors into `BlockFP8FusedExperts` (`expert`: a regex of one
    expert's prefix with a group `e`; `dest`: the experts module's parameter prefix): gate
    then up rows and their own scale rows into w13, down's inputs and their scale columns
    into w2, split on the intermediate dimension (ranks may share a block); stored static
    input scales whole into `w13_input_scale[e, gate | up]` and `w2_input_scale[e]` (with
    dynamic inputs, a stored one checked and dropped)."""
    layout = FusedExperts.layout(full_intermediate, tp)
    rows = BlockScaleSplit(0, fmt.block[0], full_intermediate)
    nb, scale = rows.blocks(tp), _scale_suffix(fmt)
    rules = []
    for index, part in enumerate(layout.names):
        src = rf"{expert}\.{part}_proj\."
        rules += [Rule(src + "weight", Split(0), f"{dest}.w13_weight",
                       ("e", layout.slot(part))),
                  Rule(src + scale, rows, f"{dest}.w13_weight_scale",
                       ("e", slice(index * nb, (index + 1) * nb)))]
        rules.append(_input_rule(src + _input_suffix(fmt), fmt, f"{dest}.w13_input_scale",
                                 ("e", index)))
    src = rf"{expert}\.down_proj\."
    rules += [Rule(src + "weight", Split(1), f"{dest}.w2_weight", ("e",)),
              Rule(src + scale, BlockScaleSplit(1, fmt.block[1], full_intermediate),
                   f"{dest}.w2_weight_scale", ("e",))]
    rules.append(_input_rule(src + _input_suffix(fmt), fmt, f"{dest}.w2_input_scale", ("e",)))
    return rules


def qwen3_5_parts(cfg, prefix: str) -> list[Part]:
    """Qwen3.5-MoE's attention, GDN and shared-expert modules (checkpoint names under
    `prefix`) and their engine destinations."""
    hd, heads, kv, h = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.hidden_size
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    shared = cfg.shared_expert_intermediate_size
    src, dst = f"{prefix}.layers.{{layer}}", "model.layers.{layer}"
    a, d = f"{src}.self_attn", f"{dst}.self_attn"
    g, gd = f"{src}.linear_attn", f"{dst}.linear_attn"
    m, md = f"{src}.mlp.shared_expert", f"{dst}.mlp.shared_expert"
    return [Part(f"{a}.q_proj", f"{d}.qkv_proj", (2 * heads * hd, None), (h, 1), 0,
                 interleaved=heads),
            Part(f"{a}.k_proj", f"{d}.qkv_proj", (kv * hd, kv), (h, 1), 1),
            Part(f"{a}.v_proj", f"{d}.qkv_proj", (kv * hd, kv), (h, 1), 2),
            Part(f"{a}.o_proj", f"{d}.o_proj", (h, 1), (heads * hd, None)),
            Part(f"{g}.in_proj_qkv", f"{gd}.in_proj", (2 * key + value, None), (h, 1), 0,
                 packed=(key, key, value)),
            Part(f"{g}.in_proj_z", f"{gd}.in_proj", (value, None), (h, 1), 1),
            Part(f"{g}.out_proj", f"{gd}.out_proj", (h, 1), (value, None)),
            Part(f"{m}.gate_proj", f"{md}.gate_up_proj", (shared, None), (h, 1), 0),
            Part(f"{m}.up_proj", f"{md}.gate_up_proj", (shared, None), (h, 1), 1),
            Part(f"{m}.down_proj", f"{md}.down_proj", (h, 1), (shared, None))]
