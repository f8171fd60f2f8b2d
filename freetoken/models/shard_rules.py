"""Shard-plan rules the model families share (attention, dense MLP, experts, embeddings), and
the plan of the Llama, Qwen3 and Qwen3-MoE checkpoints built from them, as data. The rule
machinery is `freetoken.loading.plan`; the specs are `freetoken.formats`."""

from __future__ import annotations

from freetoken.config import ModelConfig
from freetoken.formats.nvfp4.checkpoint import COMPRESSED_TENSORS, tensor_suffixes
from freetoken.formats.nvfp4.specs import PACKED, SCALE, GlobalScale, InputSplit, local_inputs
from freetoken.formats.quant import FP8_BLOCK, NVFP4
from freetoken.formats.specs import Heads, PaddedSplit, Replicate, Split
from freetoken.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from freetoken.layers.moe import FusedExperts
from freetoken.layers.quantization.nvfp4.moe import NVFP4FusedExperts
from freetoken.loading.plan import Rule, ShardPlan
from freetoken.models.decoder_modules import experts_format
from freetoken.models.scale_rules import (
    NVFP4_INPUT,
    block_scale_rules,
    decoder_parts,
    fp8_expert_rules,
    lm_head_rules,
)

LAYER = r"(?P<p>model\.layers\.\d+)"


def attention_rules(cfg: ModelConfig, tp: int, prefix: str = LAYER) -> list[Rule]:
    """q, k, v into the fused qkv_proj (k and v by KV head, replicated when fewer than ranks),
    o_proj split on its input."""
    rows = QKVParallelLinear.layout(cfg.head_dim, cfg.num_attention_heads,
                                    cfg.num_key_value_heads, tp)
    attn = prefix + r"\.self_attn"
    kv = Heads(cfg.num_key_value_heads)
    specs = {"q": Split(0), "k": kv, "v": kv}
    kinds = ["weight", "bias"] if cfg.attention_bias else ["weight"]
    rules = [
        Rule(rf"{attn}\.{x}_proj\.{kind}", specs[x], rf"\g<p>.self_attn.qkv_proj.{kind}",
             (rows.slot(x),))
        for x in "qkv" for kind in kinds
    ]
    rules.append(Rule(rf"{attn}\.o_proj\.weight", Split(1)))
    if cfg.attention_bias:
        rules.append(Rule(rf"{attn}\.o_proj\.bias", Replicate()))
    if cfg.qk_norm:
        rules.append(Rule(rf"{attn}\.[qk]_norm\.weight", Replicate()))
    return rules


def dense_mlp_rules(intermediate: int, tp: int, prefix: str = LAYER) -> list[Rule]:
    """gate and up split separately into the merged gate_up_proj; down split on its input."""
    rows = MergedColumnParallelLinear.layout([intermediate] * 2, tp, "intermediate_size")
    mlp = prefix + r"\.mlp"
    return [
        Rule(rf"{mlp}\.gate_proj\.weight", Split(0), r"\g<p>.mlp.gate_up_proj.weight",
             (rows.slot("gate"),)),
        Rule(rf"{mlp}\.up_proj\.weight", Split(0), r"\g<p>.mlp.gate_up_proj.weight",
             (rows.slot("up"),)),
        Rule(rf"{mlp}\.down_proj\.weight", Split(1)),
    ]


def expert_rules(expert: str, dest: str, full_intermediate: int, tp: int,
                 producer: str | None = None) -> list[Rule]:
    """Per-expert checkpoint tensors into a layer's stacked experts, split on the intermediate
    dimension: gate rows then up rows into w13, down on its input into w2.

    `expert` is a regex of one expert's prefix with a group `e` for its index, `dest` the
    experts module's parameter prefix as a `re` template. `producer` None: unquantized weights
    into `FusedExperts` (`w13`, `w2`). Else the NVFP4 producer (`modelopt`,
    `compressed-tensors`): weights and block scales into `NVFP4FusedExperts`, down's inputs
    split on 16-element groups, gate's and up's global scales into w13_weight_scale_2[e, 0]
    and [e, 1]; input scales, unused by W4A16, are checked finite and above 0 and dropped."""
    if producer is not None:
        return _nvfp4_expert_rules(expert, dest, full_intermediate, tp, producer)
    rows = FusedExperts.layout(full_intermediate, tp)
    return [
        Rule(rf"{expert}\.gate_proj\.weight", Split(0), f"{dest}.w13", ("e", rows.slot("gate"))),
        Rule(rf"{expert}\.up_proj\.weight", Split(0), f"{dest}.w13", ("e", rows.slot("up"))),
        Rule(rf"{expert}\.down_proj\.weight", Split(1), f"{dest}.w2", ("e",)),
    ]


def _nvfp4_expert_rules(expert: str, dest: str, full_intermediate: int, tp: int,
                        producer: str) -> list[Rule]:
    layout = NVFP4FusedExperts.layout(full_intermediate, tp)
    names = {field: suffix for suffix, field in tensor_suffixes(producer).items()}
    glob = GlobalScale((1,) if producer == COMPRESSED_TENSORS else ())
    rules = []
    for index, part in enumerate(layout.names):
        src, rows = rf"{expert}\.{part}_proj\.", layout.slot(part)
        rules += [Rule(src + names["weight"], Split(0), f"{dest}.w13_weight", ("e", rows)),
                  Rule(src + names["weight_scale"], Split(0), f"{dest}.w13_weight_scale",
                       ("e", rows)),
                  Rule(src + names["weight_scale_2"], glob, f"{dest}.w13_weight_scale_2",
                       ("e", index))]
    src = rf"{expert}\.down_proj\."
    rules += [Rule(src + names["weight"], InputSplit(PACKED, 1), f"{dest}.w2_weight", ("e",)),
              Rule(src + names["weight_scale"], InputSplit(SCALE, 1), f"{dest}.w2_weight_scale",
                   ("e",)),
              Rule(src + names["weight_scale_2"], glob, f"{dest}.w2_weight_scale_2", ("e",))]
    rules.append(Rule(rf"{expert}\.(gate|up|down)_proj\.{names['input_scale']}", param=None,
                      checked=NVFP4_INPUT))
    return rules


def embedding_rules(cfg: ModelConfig) -> list[Rule]:
    rules = [
        Rule(r"model\.embed_tokens\.weight", PaddedSplit(cfg.vocab_size)),
        Rule(r"model\.norm\.weight", Replicate()),
        Rule(rf"{LAYER}\.(input_layernorm|post_attention_layernorm)\.weight", Replicate()),
    ]
    # A tied checkpoint may still carry lm_head.weight; HF ignores it, so do we.
    head = None if cfg.tie_word_embeddings else r"\g<0>"
    rules.append(Rule(r"lm_head\.weight", PaddedSplit(cfg.vocab_size), head))
    return rules


def decoder_plan(cfg: ModelConfig, tp: int) -> ShardPlan:
    """The plan for Llama, Qwen3 and Qwen3-MoE checkpoints at `tp` ranks."""
    rules = embedding_rules(cfg) + attention_rules(cfg, tp)
    if cfg.intermediate_size and any(not cfg.is_moe_layer(i)
                                     for i in range(cfg.num_hidden_layers)):
        rules += dense_mlp_rules(cfg.intermediate_size, tp)
    if cfg.num_experts:
        rules.append(Rule(rf"{LAYER}\.mlp\.gate\.weight", Replicate()))
        expert, dest, fmt = rf"{LAYER}\.mlp\.experts\.(?P<e>\d+)", r"\g<p>.mlp.experts", \
            experts_format(cfg)
        if fmt is not None and fmt.kind == FP8_BLOCK:
            rules += fp8_expert_rules(expert, dest, cfg.moe_intermediate_size, tp, fmt)
        else:
            rules += expert_rules(expert, dest, cfg.moe_intermediate_size, tp,
                                  fmt.producer if fmt is not None else None)
    rules += block_scale_rules(cfg, range(cfg.num_hidden_layers), decoder_parts(cfg), tp)
    rules += lm_head_rules(cfg)
    return ShardPlan(rules, tp)


def check_decoder_tp(cfg: ModelConfig, tp: int) -> None:
    """ValueError naming the first dimension of a Llama-style decoder `tp` ranks cannot split
    (attention heads, KV heads unless replicated, dense and expert intermediate sizes)."""
    QKVParallelLinear.layout(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                             tp)
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        MergedColumnParallelLinear.layout([cfg.intermediate_size] * 2, tp, "intermediate_size")
    if cfg.num_experts:
        FusedExperts.layout(cfg.moe_intermediate_size, tp)
        fmt = experts_format(cfg)
        if fmt is not None and fmt.kind == NVFP4:
            NVFP4FusedExperts.layout(cfg.moe_intermediate_size, tp)
    check_nvfp4_inputs(cfg, tp, {"self_attn.o_proj": (cfg.num_attention_heads * cfg.head_dim,
                                                      "num_attention_heads x head_dim"),
                                 "mlp.down_proj": (cfg.intermediate_size,
                                                   "intermediate_size")})


def check_nvfp4_inputs(cfg: ModelConfig, tp: int, row_parallel: dict) -> None:
    """ShardError naming the dimension when a row-parallel NVFP4 linear (engine name ending
    in a key of `row_parallel`: (full inputs, dimension name)) cannot split its inputs on
    16-element groups across `tp` ranks; checked before any rank starts."""
    for name, gemms in cfg.module_formats.items():
        for suffix, (full, what) in row_parallel.items():
            if name.endswith("." + suffix) and gemms[0].format.kind == NVFP4:
                local_inputs(full, tp, f"{name} ({what})")
